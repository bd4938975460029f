"""Which of Hydra's own settings (`hydra.*`) miles-run honours; every other one is refused, never ignored.

Honoured: `hydra.searchpath` (user config folders) always; `hydra.run.dir` by a single run (the run folder is
exactly that folder); `hydra.sweep.dir`, `hydra.sweep.subdir` and the launcher (`hydra/launcher=...`,
`hydra.launcher.*`) by `--multirun`, where Hydra itself places and starts the jobs. With the Slurm launcher
(`hydra/launcher=miles_slurm`) a single run is a sweep of one job, so the sweep settings apply to it too. A
`hydra.launcher.FIELD` must be one of the chosen launcher's settings (its ConfigStore entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import OmegaConf

from miles_runner.config.provenance import COMMAND_LINE, DEFAULT, Provenance
from miles_runner.config.schema import RunConfig
from miles_runner.config.sources import SEARCHPATH_KEY
from miles_runner.core.errors import PlanError, Problem
from miles_runner.core.paths import conf_dir

SEARCHPATH = SEARCHPATH_KEY
RUN_DIR = "hydra.run.dir"
SWEEP_DIR_KEY = "hydra.sweep.dir"
SWEEP_KEYS = (SWEEP_DIR_KEY, "hydra.sweep.subdir")
LAUNCHER_GROUP, LAUNCHER_PREFIX = "hydra/launcher", "hydra.launcher."
SLURM_LAUNCHER = "miles_slurm"  # hydra_plugins/miles_slurm_launcher: a single run is submitted as one job
BASIC_LAUNCHER = "basic"
CHDIR = "hydra.job.chdir"
HYDRA_RUN_DIR_DEFAULT = "outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}"  # Hydra's, when config.yaml sets none
HYDRA_SWEEP_DIR_DEFAULT = "multirun/${now:%Y-%m-%d}/${now:%H-%M-%S}"
HONOURED = (
    "miles-run honours hydra.searchpath, hydra.run.dir (single runs), hydra.sweep.dir/subdir and hydra/launcher "
    "(--multirun, or any run with hydra/launcher=miles_slurm)"
)


def override_key(text: str) -> str:
    """`+a.b=1` -> `a.b`; `~a.b` -> `a.b`."""
    return text.partition("=")[0].lstrip("+~")


def is_hydra_key(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def hydra_setting_problems(overrides: Sequence[str], *, multirun: bool) -> list[Problem]:
    """A problem for each command-line `hydra.*` setting this mode would not honour."""
    launcher = launcher_choice(overrides)
    slurm = launcher == SLURM_LAUNCHER
    problems = []
    for text in overrides:
        key = override_key(text)
        if not is_hydra_key(key):
            continue
        if slurm and key == RUN_DIR:  # a single run under Slurm is a one-job sweep
            problem = hydra_setting_problem(key, text, multirun=True)
        else:
            problem = hydra_setting_problem(key, text, multirun=multirun or slurm)
        if problem is None and key.startswith(LAUNCHER_PREFIX):
            problem = launcher_field_problem(launcher, key, text)
        if problem:
            problems.append(problem)
    return problems


def launcher_choice(overrides: Sequence[str]) -> str:
    """The launcher the command line picks (hydra/launcher=NAME), else Hydra's basic one."""
    chosen = [o.partition("=")[2] for o in overrides if override_key(o) == LAUNCHER_GROUP]
    return chosen[-1] if chosen else BASIC_LAUNCHER


def uses_slurm_launcher(overrides: Sequence[str]) -> bool:
    return launcher_choice(overrides) == SLURM_LAUNCHER


def launcher_fields(launcher: str) -> list[str] | None:
    """The settings of a launcher registered in Hydra's ConfigStore (plugins register on Hydra's plugin scan);
    None for one known only from a config folder."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # imports every hydra_plugins.* module, which stores its launcher's settings
    try:
        node = ConfigStore.instance().load(f"{LAUNCHER_GROUP}/{launcher}.yaml").node
    except Exception:
        return None
    return sorted(str(k) for k in node if k != "_target_")


def launcher_field_problem(launcher: str, key: str, text: str) -> Problem | None:
    valid = launcher_fields(launcher)
    name = key.removeprefix(LAUNCHER_PREFIX).split(".")[0]
    if valid is None or name in valid:
        return None
    listed = ", ".join(valid) if valid else "none"
    return Problem(
        "hydra-launcher-setting-unknown",
        [(text, COMMAND_LINE)],
        f"hydra/launcher={launcher} has no setting '{name}'; its settings: {listed}.",
        f"drop {text}" if not valid else f"use one of: {listed}",
    )


def hydra_setting_problem(key: str, text: str, *, multirun: bool) -> Problem | None:
    setting = [(text, COMMAND_LINE)]
    if key == SEARCHPATH:
        if text.startswith(SEARCHPATH + "="):
            return None
        return Problem(
            "hydra-searchpath-spelling",
            setting,
            "Hydra takes its search path only from a plain hydra.searchpath=[...] override; written with "
            "+, ++ or ~ it would add no folder.",
            f"{SEARCHPATH}={text.partition('=')[2] or '[file:///DIR]'}",
        )
    if key == CHDIR:
        return None if text.partition("=")[2].strip().lower() == "false" else chdir_problem(setting)
    is_launcher = key == LAUNCHER_GROUP or key.startswith(LAUNCHER_PREFIX)
    if key == RUN_DIR:
        if not multirun:
            return None
        return Problem(
            "hydra-run-dir-in-sweep",
            setting,
            "A sweep puts each job in hydra.sweep.dir/hydra.sweep.subdir; hydra.run.dir is the folder of "
            "a single run, so the sweep would not use it.",
            f"hydra.sweep.dir={text.partition('=')[2]}",
        )
    if key in SWEEP_KEYS or is_launcher:
        if multirun:
            return None
        return Problem(
            "hydra-setting-needs-multirun",
            setting,
            f"{key} places or starts the jobs of a --multirun sweep; a single run never reads it "
            "(its folder is hydra.run.dir, its servers are started by the executor).",
            "add --multirun (or hydra/launcher=miles_slurm), or set the run folder with hydra.run.dir=DIR",
        )
    return Problem(
        "hydra-setting-unsupported",
        setting,
        f"miles-run does not implement {key}: it would be accepted and have no effect. {HONOURED}.",
        f"drop {text}",
    )


def chdir_problem(setting: list[tuple[str, str]]) -> Problem:
    return Problem(
        "hydra-chdir-unsupported",
        setting,
        "miles-run keeps the working directory: relative data paths and run.output_root are resolved "
        "against it, and the run folder already holds every file a run writes.",
        "hydra.job.chdir=false (or drop it)",
    )


def composed_setting_problems(cfg: Any, overrides: Sequence[str]) -> list[Problem]:
    """Settings a config file (a recipe, a user folder) put into the composed `hydra` node."""
    on_command_line = {override_key(o) for o in overrides}
    if CHDIR not in on_command_line and OmegaConf.select(cfg, CHDIR) is True:
        return [chdir_problem([(f"{CHDIR}=true", "a config file")])]
    return []


@cache
def shipped_run_dir() -> str:
    """hydra.run.dir as the shipped config.yaml writes it (unresolved)."""
    config = yaml.safe_load((conf_dir() / "config.yaml").read_text()) or {}
    return str(((config.get("hydra") or {}).get("run") or {}).get("dir") or HYDRA_RUN_DIR_DEFAULT)


def user_run_dir(cfg: Any) -> str:
    """hydra.run.dir, resolved, when something other than the shipped config.yaml set it; else ""."""
    raw = cast(dict[str, Any], OmegaConf.to_container(cfg.hydra.run, resolve=False)).get("dir")
    return "" if raw is None or raw == shipped_run_dir() else str(cfg.hydra.run.dir)


def run_folder_problems(run_dir: str, run: RunConfig, provenance: Provenance) -> list[Problem]:
    """hydra.run.dir is the run folder itself: it cannot be combined with run.dir or run.output_root, and it
    cannot start a new run in a folder that already holds one."""
    if not run_dir:
        return []
    setting = (f"{RUN_DIR}={run_dir}", str(provenance.origin(RUN_DIR)))
    problems = []
    if run.dir:
        problems.append(
            Problem(
                "run-folder-set-twice",
                [setting, (f"run.dir={run.dir}", str(provenance.origin("run.dir")))],
                "hydra.run.dir is the folder of this run and run.dir the folder of a run to resume; "
                "a run has one folder.",
                f"drop {RUN_DIR} (run.dir={run.dir} resumes that run in its own folder)",
            )
        )
    root_origin = provenance.origin("run.output_root")
    if root_origin.kind != DEFAULT:
        problems.append(
            Problem(
                "run-folder-set-twice",
                [setting, (f"run.output_root={run.output_root}", str(root_origin))],
                "hydra.run.dir is the run folder itself, so run.output_root would have no effect.",
                f"drop run.output_root, or drop {RUN_DIR} to run in run.output_root/DATE/TIME",
            )
        )
    if not run.resume and (Path(run_dir) / "plan.yaml").exists():
        problems.append(
            Problem(
                "run-folder-taken",
                [setting],
                "That folder already holds a run (plan.yaml); a new run there would overwrite its record.",
                f"run.resume=true to continue that run, or another {RUN_DIR}",
            )
        )
    return problems


@cache
def shipped_sweep_dir() -> str:
    """hydra.sweep.dir as the shipped config.yaml writes it (unresolved)."""
    config = yaml.safe_load((conf_dir() / "config.yaml").read_text()) or {}
    return str(((config.get("hydra") or {}).get("sweep") or {}).get("dir") or HYDRA_SWEEP_DIR_DEFAULT)


def sweep_dir_overrides(overrides: Sequence[str], output_roots: set[str]) -> list[str]:
    """A sweep honours run.output_root: its jobs go to OUTPUT_ROOT/multirun/DATE/TIME (the shipped layout under
    that root) unless hydra.sweep.dir is set. Raises PlanError when the points disagree on run.output_root."""
    default_root = RunConfig().output_root
    if any(override_key(o) == SWEEP_KEYS[0] for o in overrides) or output_roots <= {default_root}:
        return []
    if len(output_roots) > 1:
        raise PlanError(
            [
                Problem(
                    "sweep-needs-one-output-root",
                    [(f"run.output_root={r}", COMMAND_LINE) for r in sorted(output_roots)],
                    "The jobs of a sweep share one sweep folder, so run.output_root cannot differ between them.",
                    "set one run.output_root, or hydra.sweep.dir=DIR",
                )
            ]
        )
    [root] = output_roots
    layout = shipped_sweep_dir()
    tail = layout.removeprefix(default_root) if layout.startswith(default_root + "/") else "/" + layout
    value = root.rstrip("/") + tail
    return [f"{SWEEP_KEYS[0]}='" + value.replace("'", "\\'") + "'"]  # Hydra escapes only quotes in quotes
