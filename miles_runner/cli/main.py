"""`miles-run`: compose -> check -> plan -> (run). Every problem is reported before anything starts.

    miles-run [+recipe=NAME] [group=option ...] [key=value ...]     compile, save and run the plan
    miles-run ... --plan                                             compile, save and print it; start nothing
    miles-run ... --debug                                            a failed run also prints its traceback
                                                                     (it is always in RUN_DIR/logs/driver.log)
    miles-run --recipes                                              list the recipes (shipped and your own)
    miles-run --multirun ... a=x,y                                   a Hydra sweep; every point is checked first
    miles-run --config-dir DIR ...                                   also read your recipes (DIR/recipe/NAME.yaml)
                                                                     and group options (DIR/GROUP/OPTION.yaml);
                                                                     repeatable; hydra.searchpath=[file://DIR]
                                                                     does the same

Hydra's own settings: hydra.run.dir=DIR is the run folder itself (a single run); hydra.sweep.dir,
hydra.sweep.subdir and hydra/launcher=NAME place and start the jobs of --multirun; hydra.searchpath adds config
folders. Any other hydra.* setting is refused. Built tiny models are cached in $MILES_CACHE_DIR (default
~/.cache/miles-runner).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from miles_runner.cli.hydra_app import launch_multirun
from miles_runner.cli.pipeline import execute, new_run_folder, record_plan, resumed_plan, run_to_resume
from miles_runner.config.compose import ComposedConfig, compose
from miles_runner.config.hydra_settings import hydra_setting_problems, run_folder_problems, sweep_dir_overrides
from miles_runner.config.sources import (
    config_dir_problems,
    config_sources,
    missing_folder_problems,
    recipes,
    searchpath_entries,
    with_searchpath,
)
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan

EXIT_PLAN_ERROR = 2
OWN_FLAGS = {"--plan", "--recipes", "--help", "-h", "--multirun", "-m", "--debug"}
CONFIG_DIR_FLAG = "--config-dir"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        config_dirs, rest = split_config_dirs(args)
    except ValueError as exc:
        print(f"miles-run: {exc}", file=sys.stderr)
        return EXIT_PLAN_ERROR
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
    composed, plan = checked_plan(overrides)
    resumed = run_to_resume(composed, plan.name)
    if resumed is not None:
        plan, run_dir = resumed_plan(resumed, plan), resumed
    else:
        run_dir = new_run_folder(composed)
        record_plan(composed, plan, run_dir, argv)
    if plan_only:
        return 0
    return execute(plan, run_dir, resume=resumed is not None, debug=debug)


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
        for job, exc in failures:
            print(f"miles-run: sweep point [{' '.join(job)}]: {exc}\n", file=sys.stderr)
        return EXIT_PLAN_ERROR
    return launch_multirun([*overrides, *sweep_dir_overrides(overrides, output_roots)], plan_only=plan_only,
                           debug=debug)


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
