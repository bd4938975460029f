"""The one pipeline every entry point runs: composed config -> plan -> run record -> (execute).

`miles-run` (a run, `--plan`, each point of a sweep) and the Hydra job of a multirun both go through
`record_plan` and `execute`, so a plan is compiled, saved and printed the same way whichever started it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from miles_runner.cli.failure import driver_log, failure_report, format_traceback, log_traceback
from miles_runner.config.compose import ComposedConfig
from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.plan.record import new_run_dir, read_plan, write_run_record
from miles_runner.plan.summary import summarize
from miles_runner.tracking.job_result import COMPLETED, FAILED, INTERRUPTED, STOPPED, write_result

EXIT_RUN_FAILED = 1  # a component failed during the run
EXIT_RUN_STOPPED = 3  # a check during the run stopped it (2 is a plan error: nothing started)
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


def plan_and_record(composed: ComposedConfig, run_dir: Path, argv: list[str]) -> Plan:
    """Compile the plan (PlanError lists every problem), save the run record, print the summary."""
    plan = compile_plan(composed)
    record_plan(composed, plan, run_dir, argv)
    return plan


def record_plan(composed: ComposedConfig, plan: Plan, run_dir: Path, argv: list[str]) -> None:
    plan_path = write_run_record(run_dir, composed, plan, argv)
    print(summarize(plan, str(plan_path)))


def resumed_plan(run_dir: Path, compiled: Plan) -> Plan:
    """A resumed run executes the plan it saved; a different freshly compiled plan is reported, not used."""
    saved = read_plan(run_dir / "plan.yaml")
    if saved != compiled:
        print(
            f"miles-run: resuming {run_dir} with its saved plan (the config now compiles to a different one)",
            file=sys.stderr,
        )
    print(summarize(saved, str(run_dir / "plan.yaml")))
    return saved


def resume_dir(output_root: str, name: str, explicit: str, setting: str = "run.dir") -> Path | None:
    """The explicit folder (run.dir, or hydra.run.dir), else the newest run folder under output_root whose
    saved plan has this name."""
    if explicit:
        folder = Path(explicit)
        if not (folder / "plan.yaml").exists():
            raise PlanError(
                [
                    Problem(
                        "resume-needs-a-run-folder",
                        [(f"{setting}={explicit}", "command line")],
                        "That folder holds no plan.yaml of an earlier run.",
                        "",
                    )
                ]
            )
        return folder
    candidates = sorted(Path(output_root).glob("*/*/plan.yaml"), key=lambda p: p.stat().st_mtime, reverse=True)
    for plan_file in candidates:
        if yaml.safe_load(plan_file.read_text()).get("name") == name:
            return plan_file.parent
    return None


def run_to_resume(composed: ComposedConfig, name: str) -> Path | None:
    """The folder of the earlier run this one continues, or None for a new run. With hydra.run.dir set, that
    folder is the one to resume (run.resume=true)."""
    run = composed.config.run
    if composed.run_dir:
        return resume_dir(run.output_root, name, composed.run_dir, "hydra.run.dir") if run.resume else None
    return resume_dir(run.output_root, name, run.dir) if run.resume or run.dir else None


def new_run_folder(composed: ComposedConfig) -> Path:
    """hydra.run.dir exactly, when set; else run.output_root/DATE/TIME."""
    if composed.run_dir:
        folder = Path(composed.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    return new_run_dir(composed.config.run.output_root)


def execute(plan: Plan, run_dir: Path, *, resume: bool = False, debug: bool = False) -> int:
    """Run the plan: the executor starts its servers, the loop trains, everything is stopped at the end. A
    failure ends with one report on stderr (component, reason, its log's tail, the run folder); the traceback
    goes to RUN_DIR/logs/driver.log, and to stderr too with `debug`. Whatever the outcome, RUN_DIR/result.json
    says how it ended."""
    started = time.monotonic()
    status, code = FAILED, EXIT_RUN_FAILED
    try:
        status, code = _run(plan, run_dir, resume=resume, debug=debug)
    finally:
        write_result(run_dir, status, code, time.monotonic() - started)
    return code


def _run(plan: Plan, run_dir: Path, *, resume: bool, debug: bool) -> tuple[str, int]:
    # Imported here, not at the top: the loops pull in torch, ray and transformers, which planning never needs.
    from miles_runner.loops.run import run_plan
    from miles_runner.weight_sync.verify import SyncVerificationError

    with driver_log(run_dir) as log:
        try:
            run_plan(plan, run_dir, resume=resume)
        except KeyboardInterrupt as stop:
            cause = str(stop) or "Ctrl-C"  # recorded_run raises it for SIGTERM with the signal as its text
            print(
                f"miles-run: stopped by {cause}; every process it started was stopped.\nrun folder: {run_dir}",
                file=sys.stderr,
            )
            return INTERRUPTED, EXIT_INTERRUPTED
        except Exception as error:
            report = failure_report(error, run_dir, log)
            log_traceback(error)
            print(report + ("\n\n" + format_traceback(error) if debug else ""), file=sys.stderr)
            # a push the engines did not take: the run stopped itself, nothing was trained on it
            if isinstance(error, SyncVerificationError):
                return STOPPED, EXIT_RUN_STOPPED
            return FAILED, EXIT_RUN_FAILED
    print(f"run folder: {run_dir}")
    return COMPLETED, 0
