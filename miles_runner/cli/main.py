"""`miles-run`: compose -> check -> plan -> (run). Every problem is reported before anything starts.

    miles-run [+recipe=NAME] [group=option ...] [key=value ...]     compile, save and run the plan
    miles-run ... --plan                                             compile, save and print it; start nothing
    miles-run ... --debug                                            a failed run also prints its traceback
                                                                     (it is always in RUN_DIR/logs/driver.log)
    miles-run --recipes                                              list the recipes (shipped and your own)
    miles-run --multirun ... a=x,y                                   a Hydra sweep; every point is checked first
                                                                     and it ends with a summary (also in the
                                                                     sweep folder's sweep_summary.md); exit 1
                                                                     when a job failed
    miles-run --config-dir DIR ...                                   also read your recipes (DIR/recipe/NAME.yaml)
                                                                     and group options (DIR/GROUP/OPTION.yaml);
                                                                     repeatable; hydra.searchpath=[file://DIR]
                                                                     does the same

On a Slurm cluster (hydra/launcher=miles_slurm): each job runs under its own Ray (executor=ray), on the plan's
cluster.nodes x cluster.gpus_per_node; hydra.launcher.* sets partition, account, qos, time, cpus_per_task, mem,
setup, srun_args, extra_sbatch, requeue, wait, nodes_timeout_s, python.
    miles-run -m ... hydra/launcher=miles_slurm a=x,y                 submit the sweep as one job array and exit
                                                                     (the sweep folder gets slurm_manifest.json);
                                                                     hydra.launcher.wait=true blocks until the
                                                                     jobs end and prints their results
    miles-run ... hydra/launcher=miles_slurm                         without -m: submit this one run as a
                                                                     one-job sweep (placed by hydra.sweep.dir)
    miles-run ... hydra/launcher=miles_slurm --plan                  print each job's sbatch script; submit nothing
    miles-run --status SWEEP_DIR                                     each job's Slurm state, nodes and folder; once
                                                                     every job ended, the sweep summary

Hydra's own settings: hydra.run.dir=DIR is the run folder itself (a single run); hydra.sweep.dir,
hydra.sweep.subdir and hydra/launcher=NAME place and start the jobs of --multirun (and of any run with
hydra/launcher=miles_slurm); hydra.searchpath adds config folders. Any other hydra.* setting is refused. Built
tiny models are cached in $MILES_CACHE_DIR, else a source checkout's .cache/, else ~/.cache/miles-runner.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from miles_runner.cli.hydra_app import launch_multirun
from miles_runner.cli.pipeline import execute, new_run_folder, record_plan, resumed_plan, run_to_resume
from miles_runner.cli.slurm import print_job_scripts, slurm_point_problems, sweep_status
from miles_runner.config.compose import ComposedConfig, compose
from miles_runner.config.hydra_settings import (
    hydra_setting_problems,
    run_folder_problems,
    sweep_dir_overrides,
    uses_slurm_launcher,
)
from miles_runner.config.sources import (
    config_dir_problems,
    config_sources,
    missing_folder_problems,
    recipes,
    searchpath_entries,
    with_searchpath,
)
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan, plan_or_design
from miles_runner.plan.model import Plan
from miles_runner.plan.summary import summarize
from miles_runner.slurm.contradictions import executor_problems, with_executor

EXIT_PLAN_ERROR = 2
OWN_FLAGS = {"--plan", "--recipes", "--help", "-h", "--multirun", "-m", "--debug"}
CONFIG_DIR_FLAG = "--config-dir"
STATUS_FLAG = "--status"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config_dirs, rest = split_config_dirs(args)
    except ValueError as exc:
        print(f"miles-run: {exc}", file=sys.stderr)
        return EXIT_PLAN_ERROR
    if rest and rest[0] == STATUS_FLAG:
        return sweep_status(rest[1:])
    flags = {a for a in rest if a in OWN_FLAGS}
    overrides = [a for a in rest if a not in OWN_FLAGS]
    if flags & {"--help", "-h"}:
        print(__doc__.strip())
        return 0
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        print(f"miles-run: unknown option {unknown[0]}; see miles-run --help", file=sys.stderr)
        return EXIT_PLAN_ERROR
    try:
        overrides = with_config_dirs(overrides, config_dirs)
        if "--recipes" in flags:
            print(list_recipes(searchpath_entries(overrides)))
            return 0
        plan_only, debug = "--plan" in flags, "--debug" in flags
        if uses_slurm_launcher(overrides):
            return slurm_launch(overrides, plan_only=plan_only, debug=debug)
        if flags & {"--multirun", "-m"}:
            return multirun(overrides, plan_only=plan_only, debug=debug)
        return single_run(overrides, plan_only=plan_only, debug=debug, argv=args)
    except PlanError as exc:
        print(f"miles-run: {exc}", file=sys.stderr)
        return EXIT_PLAN_ERROR


def split_config_dirs(args: list[str]) -> tuple[list[str], list[str]]:
    """(the folders of every `--config-dir DIR` / `--config-dir=DIR`, the other arguments in order)."""
    folders: list[str] = []
    rest: list[str] = []
    items = iter(args)
    for arg in items:
        if arg == CONFIG_DIR_FLAG:
            folder = next(items, None)
            if folder is None or folder.startswith("-"):
                raise ValueError(f"{CONFIG_DIR_FLAG} needs a folder: {CONFIG_DIR_FLAG} DIR")
            folders.append(folder)
        elif arg.startswith(CONFIG_DIR_FLAG + "="):
            folders.append(arg.partition("=")[2])
        else:
            rest.append(arg)
    return folders, rest


def with_config_dirs(overrides: list[str], folders: Sequence[str]) -> list[str]:
    """The overrides with each --config-dir folder added to hydra.searchpath; every folder must exist."""
    if problems := config_dir_problems(folders):
        raise PlanError(problems)
    return with_searchpath(overrides, folders)


def single_run(overrides: list[str], *, plan_only: bool, argv: list[str], debug: bool = False) -> int:
    try:
        composed, plan = checked_plan(overrides)
    except PlanError:
        if plan_only:
            print_refused_design(overrides)
        raise
    resumed = run_to_resume(composed, plan.name)
    if resumed is not None:
        plan, run_dir = resumed_plan(resumed, plan), resumed
    else:
        run_dir = new_run_folder(composed)
        record_plan(composed, plan, run_dir, argv)
    if plan_only:
        return 0
    return execute(plan, run_dir, resume=resumed is not None, debug=debug)


def print_refused_design(overrides: list[str]) -> None:
    """`--plan` of a plan this release refuses only for what it has not built: what its design would run, labelled
    so (nothing is saved); the refusal follows on stderr."""
    try:
        design, refusal = plan_or_design(compose(overrides))
    except PlanError:
        return
    if refusal is not None:
        print("DESIGN ONLY, NOT RUNNABLE: this release refuses the plan (below); this is what its design would run.")
        print(summarize(design, "(not saved)"))


def checked_plan(overrides: list[str]) -> tuple[ComposedConfig, Plan]:
    """The composed config and its plan, or one PlanError with every problem: hydra.* settings a single run
    does not honour, composition, the run folder settings and the plan's rules."""
    problems = hydra_setting_problems(overrides, multirun=False)
    try:
        composed = compose(overrides)
    except PlanError as exc:
        raise PlanError(problems + exc.problems) from None
    problems += run_folder_problems(composed.run_dir, composed.config.run, composed.provenance)
    try:
        plan = compile_plan(composed)
    except PlanError as exc:
        raise PlanError(problems + exc.problems) from None
    if problems:
        raise PlanError(problems)
    return composed, plan


def multirun(overrides: list[str], *, plan_only: bool, debug: bool) -> int:
    """Check every point of the sweep before Hydra launches any of them."""
    if problems := hydra_setting_problems(overrides, multirun=True):
        raise PlanError(problems)
    failures, output_roots = [], set()
    for job in sweep_points(overrides):
        try:
            composed = compose(job)
            compile_plan(composed)
            output_roots.add(composed.config.run.output_root)
        except PlanError as exc:
            failures.append((job, exc))
    if failures:
        for job, error in failures:
            print(f"miles-run: sweep point [{' '.join(job)}]: {error}\n", file=sys.stderr)
        return EXIT_PLAN_ERROR
    return launch_multirun(
        [*overrides, *sweep_dir_overrides(overrides, output_roots)], plan_only=plan_only, debug=debug
    )


def slurm_launch(overrides: list[str], *, plan_only: bool, debug: bool) -> int:
    """hydra/launcher=miles_slurm, with or without --multirun: the jobs go to Slurm, each under its own Ray
    (a single run is a sweep of one job). With --plan, each job's sbatch script is printed instead."""
    if problems := hydra_setting_problems(overrides, multirun=True) + executor_problems(overrides):
        raise PlanError(problems)
    overrides = with_executor(overrides)
    points = sweep_points(overrides)
    if plan_only:
        return print_job_scripts(points, overrides)
    if problems := slurm_point_problems(points, overrides):
        raise PlanError(problems)
    return multirun(overrides, plan_only=False, debug=debug)


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The override list of every job a basic Hydra sweep would launch."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def list_recipes(searchpath: Sequence[str] = ()) -> str:
    """One line per recipe: name and description; with user folders, also the folder each comes from."""
    if problems := missing_folder_problems(searchpath):
        raise PlanError(problems)
    lines = []
    for recipe in recipes(config_sources(searchpath)):
        line = f"{recipe.name:<28} {recipe.description}"
        if searchpath:
            where = "shipped" if recipe.source.shipped else str(recipe.source.root)
            shadow = "; not used: an earlier folder has a recipe of this name" if recipe.shadowed else ""
            line += f"  [{where}{shadow}]"
        lines.append(line)
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
