"""The summary of a sweep: one row per job (number, overrides, final reward, wall time, status), on the console
and as sweep_summary.md / sweep_summary.json in the sweep folder.

It reads only the job folders (plan.yaml, provenance.json, .hydra/hydra.yaml, result.json), so it serves a sweep
whatever launched it and whether or not it has ended: `miles-run -m` prints it when its jobs are done, and
`miles-run --status` and the Slurm launcher's `wait=true` call `summarize_sweep` on the sweep folder.

    summary = summarize_sweep(sweep_dir)   # also writes the two files
    print(render_summary(summary))
    sys.exit(summary.exit_code)            # 1 when a job failed, was stopped or interrupted
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from miles_runner.cli.failure import DRIVER_LOG
from miles_runner.tracking.job_result import COMPLETED, JobResult, read_result

PENDING, RUNNING = "pending", "running"  # no result.json yet: not started / started (logs/driver.log exists)
SUMMARY_MD, SUMMARY_JSON = "sweep_summary.md", "sweep_summary.json"
PLAN_FILE, PROVENANCE_FILE, HYDRA_FILE = "plan.yaml", "provenance.json", ".hydra/hydra.yaml"
COLUMNS = ("job", "overrides", "final reward", "wall time", "status")


@dataclass(frozen=True)
class JobSummary:
    number: int | None  # hydra.job.num (None when the folder does not say)
    run_dir: str
    overrides: list[str]  # the job's own command-line overrides, as its run record keeps them
    status: str  # completed | failed | stopped | interrupted (result.json), or pending | running
    final_reward: float | None = None
    adapter_rewards: dict[str, float] = field(default_factory=dict)
    wall_s: float | None = None
    steps: int | None = None
    exit_code: int | None = None


@dataclass(frozen=True)
class SweepSummary:
    sweep_dir: str
    jobs: list[JobSummary]

    @property
    def failed(self) -> list[JobSummary]:
        """The jobs that ended without completing."""
        return [j for j in self.jobs if j.status not in (COMPLETED, PENDING, RUNNING)]

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0


def summarize_sweep(sweep_dir: str | Path, *, write: bool = True) -> SweepSummary:
    """Every job folder under `sweep_dir` (a folder holding a plan.yaml), in job order; with `write`, also
    SWEEP_DIR/sweep_summary.md and sweep_summary.json."""
    folder = Path(sweep_dir)
    jobs = sorted(
        (job_summary(p.parent) for p in folder.rglob(PLAN_FILE)),
        key=lambda j: (j.number is None, j.number or 0, j.run_dir),
    )
    summary = SweepSummary(str(folder), jobs)
    if write:
        (folder / SUMMARY_JSON).write_text(json.dumps(asdict(summary), indent=1))
        (folder / SUMMARY_MD).write_text(markdown(summary))
    return summary


def job_summary(run_dir: Path) -> JobSummary:
    number, overrides = job_number(run_dir), job_overrides(run_dir)
    result: JobResult | None = read_result(run_dir)
    if result is None:
        status = RUNNING if (run_dir / "logs" / DRIVER_LOG).exists() else PENDING
        return JobSummary(number, str(run_dir), overrides, status)
    return JobSummary(
        number,
        str(run_dir),
        overrides,
        result.status,
        result.final_reward,
        result.adapter_rewards,
        result.wall_s,
        result.steps,
        result.exit_code,
    )


def job_number(run_dir: Path) -> int | None:
    """hydra.job.num from the job's .hydra/hydra.yaml, else the folder's name when it is a number."""
    hydra_file = run_dir / HYDRA_FILE
    if hydra_file.exists():
        number = ((yaml.safe_load(hydra_file.read_text()) or {}).get("hydra") or {}).get("job", {}).get("num")
        if isinstance(number, int):
            return number
    return int(run_dir.name) if run_dir.name.isdigit() else None


def job_overrides(run_dir: Path) -> list[str]:
    path = run_dir / PROVENANCE_FILE
    return list(json.loads(path.read_text()).get("argv", [])) if path.exists() else []


def render_summary(summary: SweepSummary) -> str:
    """The console table, with the counts by status and where the summary files are."""
    rows = table_rows(summary)
    widths = [max(len(str(cell)) for cell in column) for column in zip(COLUMNS, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (COLUMNS, *rows)]
    return "\n".join([f"sweep summary: {counts(summary)}", *lines, f"summary files: {summary_files(summary)}"])


def markdown(summary: SweepSummary) -> str:
    rows = [(*row, job.run_dir) for row, job in zip(table_rows(summary), summary.jobs, strict=True)]
    table = [md_row((*COLUMNS, "run folder")), "|" + "---|" * (len(COLUMNS) + 1), *map(md_row, rows)]
    return "\n".join([f"# Sweep {summary.sweep_dir}", "", counts(summary), "", *table, ""])


def md_row(cells: tuple[str, ...]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def table_rows(summary: SweepSummary) -> list[tuple[str, ...]]:
    shown = distinguishing_overrides([j.overrides for j in summary.jobs])
    return [
        (job_label(j), " ".join(o), reward_text(j), duration(j.wall_s), j.status)
        for j, o in zip(summary.jobs, shown, strict=True)
    ]


def distinguishing_overrides(per_job: list[list[str]]) -> list[list[str]]:
    """Each job's overrides less those every job shares (the swept values stand out); all of them when that
    leaves nothing, as for a one-job sweep."""
    shared = set.intersection(*(set(o) for o in per_job)) if len(per_job) > 1 else set()
    return [[o for o in overrides if o not in shared] or overrides for overrides in per_job]


def job_label(job: JobSummary) -> str:
    return f"#{job.number}" if job.number is not None else Path(job.run_dir).name


def reward_text(job: JobSummary) -> str:
    if job.final_reward is None:
        return "-"
    text = f"{job.final_reward:.4g}"
    if job.adapter_rewards:
        text += " (" + ", ".join(f"{name} {value:.4g}" for name, value in job.adapter_rewards.items()) + ")"
    return text


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def counts(summary: SweepSummary) -> str:
    by_status: dict[str, int] = {}
    for job in summary.jobs:
        by_status[job.status] = by_status.get(job.status, 0) + 1
    detail = ", ".join(f"{n} {status}" for status, n in by_status.items())
    return f"{len(summary.jobs)} job{'s' if len(summary.jobs) != 1 else ''}" + (f": {detail}" if detail else "")


def summary_files(summary: SweepSummary) -> str:
    return f"{Path(summary.sweep_dir) / SUMMARY_MD} and {SUMMARY_JSON}"
