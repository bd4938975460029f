"""`miles-run`: compose -> check -> plan -> (run). Every problem is reported before anything starts.

    miles-run [+recipe=NAME] [group=option ...] [key=value ...]     compile, save and run the plan
    miles-run ... --plan                                             compile, save and print it; start nothing
    miles-run --recipes                                              list the recipes
    miles-run --multirun ... a=x,y                                   a Hydra sweep; every point is checked first
"""

from __future__ import annotations

import sys

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from miles_runner.cli.hydra_app import launch_multirun
from miles_runner.cli.pipeline import execute, record_plan, resume_dir, resumed_plan
from miles_runner.config.compose import RECIPES_DIR, compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.record import new_run_dir

EXIT_PLAN_ERROR = 2
OWN_FLAGS = {"--plan", "--recipes", "--help", "-h", "--multirun", "-m"}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    flags = {a for a in args if a in OWN_FLAGS}
    overrides = [a for a in args if a not in OWN_FLAGS]
    if flags & {"--help", "-h"}:
        print(__doc__.strip())
        return 0
    if "--recipes" in flags:
        print(list_recipes())
        return 0
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        print(f"miles-run: unknown option {unknown[0]}; see miles-run --help", file=sys.stderr)
        return EXIT_PLAN_ERROR
    try:
        if flags & {"--multirun", "-m"}:
            return multirun(overrides, plan_only="--plan" in flags)
        return single_run(overrides, plan_only="--plan" in flags, argv=args)
    except PlanError as exc:
        print(f"miles-run: {exc}", file=sys.stderr)
        return EXIT_PLAN_ERROR


def single_run(overrides: list[str], *, plan_only: bool, argv: list[str]) -> int:
    composed = compose(overrides)
    plan = compile_plan(composed)
    run = composed.config.run
    resumed = resume_dir(run.output_root, plan.name, run.dir) if run.resume or run.dir else None
    if resumed is not None:
        plan, run_dir = resumed_plan(resumed, plan), resumed
    else:
        run_dir = new_run_dir(run.output_root)
        record_plan(composed, plan, run_dir, argv)
    if plan_only:
        return 0
    return execute(plan, run_dir, resume=resumed is not None)


def multirun(overrides: list[str], *, plan_only: bool) -> int:
    """Check every point of the sweep before Hydra launches any of them."""
    failures = []
    for job in sweep_points(overrides):
        try:
            compile_plan(compose(job))
        except PlanError as exc:
            failures.append((job, exc))
    if failures:
        for job, exc in failures:
            print(f"miles-run: sweep point [{' '.join(job)}]: {exc}\n", file=sys.stderr)
        return EXIT_PLAN_ERROR
    return launch_multirun(overrides, plan_only=plan_only)


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The override list of every job a basic Hydra sweep would launch."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def list_recipes() -> str:
    lines = []
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        comments = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
        description = next((c for c in comments if not c.startswith("@package")), "")
        lines.append(f"{path.stem:<28} {description}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
