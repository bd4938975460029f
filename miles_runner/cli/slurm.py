"""miles-run's Slurm side: `--plan` with hydra/launcher=miles_slurm prints each job's sbatch script (submitting
nothing), and `--status SWEEP_DIR` shows each job's state, nodes and folder, then the sweep summary once every
job has ended. Submitting goes through Hydra's launcher (hydra_plugins/miles_slurm_launcher)."""

from __future__ import annotations

import sys
from pathlib import Path

from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.config.compose import compose
from miles_runner.config.hydra_settings import SWEEP_KEYS, override_key
from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.compile import compile_plan, plan_or_design
from miles_runner.plan.model import Plan
from miles_runner.slurm.contradictions import settings_problems
from miles_runner.slurm.jobs import format_states, job_states
from miles_runner.slurm.script import render_job_script
from miles_runner.slurm.settings import settings_from_overrides
from miles_runner.slurm.submit import read_manifest

EXIT_PLAN_ERROR = 2
SWEEP_DIR_SHOWN = "SWEEP_DIR"  # --plan: the sweep folder is only made (with its date and time) at submission


def slurm_point_problems(points: list[list[str]], overrides: list[str]) -> list[Problem]:
    """The launcher settings that contradict a point's plan (the plan's own problems are multirun's to report)."""
    settings = settings_from_overrides(overrides)
    problems: list[Problem] = []
    for point in points:
        try:
            plan = compile_plan(compose(point))
        except PlanError:
            continue
        problems += [p for p in settings_problems(plan, settings) if p not in problems]
    return problems


def print_job_scripts(points: list[list[str]], overrides: list[str]) -> int:
    """Each point's sbatch script. A plan refused only by what this release has not built (NOT_BUILT) prints
    its design's script, labelled not submittable, and the refusal: exit 2, as for any plan error."""
    settings = settings_from_overrides(overrides)
    python = settings.python or sys.executable
    sweep_dir = next((o.partition("=")[2] for o in overrides if override_key(o) == SWEEP_KEYS[0]), SWEEP_DIR_SHOWN)
    code = 0
    for index, point in enumerate(points):
        plan, refusal = job_plan(point)
        if problems := settings_problems(plan, settings):
            raise PlanError(problems)
        script = render_job_script(plan, settings, f"{sweep_dir}/{index}", python)
        if refusal is None:
            print(f"# job {index}: {' '.join(point)}\n{script}")
            continue
        code = EXIT_PLAN_ERROR
        print(
            f"# job {index}: {' '.join(point)}\n# NOT SUBMITTABLE: this release refuses the plan (below); this is "
            f"the script its design would run.\n{script}"
        )
        print(f"miles-run: job {index} cannot be submitted: {refusal}", file=sys.stderr)
    return code


def job_plan(point: list[str]) -> tuple[Plan, PlanError | None]:
    """The plan to render and, when this release refuses it only for what it has not built, the refusal."""
    return plan_or_design(compose(point))


def sweep_status(args: list[str]) -> int:
    if len(args) != 1:
        print("miles-run: --status needs one sweep folder: miles-run --status SWEEP_DIR", file=sys.stderr)
        return EXIT_PLAN_ERROR
    sweep_dir = Path(args[0])
    try:
        manifest = read_manifest(sweep_dir)
    except FileNotFoundError as exc:
        print(f"miles-run: {exc}", file=sys.stderr)
        return EXIT_PLAN_ERROR
    states = job_states(manifest)
    print(f"Slurm job array {manifest.array_job_id} ({sweep_dir})\n{format_states(states)}")
    if all(state.ended for state in states):
        print("\n" + render_summary(summarize_sweep(sweep_dir)))
    return 0
