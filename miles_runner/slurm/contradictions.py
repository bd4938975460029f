"""One source of truth: the plan says how many nodes and GPUs a job takes and how it runs, the launcher only
how it is scheduled. A launcher setting or sbatch line that says otherwise is a plan error, never a silent
override (what submitit users hit: --nodes in one place, trainer.nnodes in another)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from miles_runner.core.errors import Problem
from miles_runner.plan.model import Plan
from miles_runner.slurm.settings import SlurmSettings

COMMAND_LINE = "command line"
# Under the launcher a job runs under the Ray the job script starts on its nodes, found through RAY_ADDRESS.
EXECUTOR_OVERRIDES = ("executor=ray", "executor.ray_address=auto")
EXECUTOR_KEYS = {"executor": "ray", "executor.kind": "ray", "executor.ray_address": "auto"}
# sbatch options that size the allocation, by the plan field that decides them.
SIZE_OPTIONS = {
    "cluster.nodes": re.compile(r"^(-N\s*|--nodes[=\s])"),
    "cluster.gpus_per_node": re.compile(
        r"^(-G\s*|--gpus[=\s]|--gpus-per-node[=\s]|--gres[=\s]*\S*gpu|--gpus-per-task)"
    ),
    "tasks (one per node: Ray's)": re.compile(r"^(-n\s*|--ntasks[=\s]|--ntasks-per-node[=\s])"),
    "array (one per sweep)": re.compile(r"^(-a\s*|--array[=\s])"),
}


def executor_problems(overrides: Sequence[str]) -> list[Problem]:
    """A job's own executor setting that is not what the launcher runs it with."""
    problems = []
    for text in overrides:
        key, _, value = text.lstrip("+").partition("=")
        wanted = EXECUTOR_KEYS.get(key)
        if wanted is not None and value.strip() != wanted:
            problems.append(
                Problem(
                    "slurm-executor-contradiction",
                    [(text, COMMAND_LINE)],
                    "Under hydra/launcher=miles_slurm every job runs with executor=ray and executor.ray_address=auto: "
                    "the Ray the job script starts on the job's nodes.",
                    f"drop {text}",
                )
            )
    return problems


def settings_problems(plan: Plan, settings: SlurmSettings) -> list[Problem]:
    """Launcher settings and extra sbatch lines that contradict the plan's nodes, GPUs or tasks."""
    cluster = plan.cluster
    problems = []
    planned = {
        "nodes": (cluster.nodes, "cluster.nodes={}"),
        "gpus_per_node": (cluster.gpus_per_node, "cluster.gpus_per_node={}"),
        "tasks_per_node": (1, "drop hydra.launcher.tasks_per_node"),
    }
    for name, (in_plan, fix) in planned.items():
        value = getattr(settings, name)
        if value is not None and value != in_plan:
            problems.append(
                Problem(
                    "slurm-setting-contradicts-plan",
                    [(f"hydra.launcher.{name}={value}", COMMAND_LINE)],
                    f"The plan decides it ({name} is {in_plan} there): the job script runs one Ray per node and the "
                    "plan's placement on them.",
                    fix.format(value),
                )
            )
    for line in settings.extra_sbatch:
        option = line.strip().removeprefix("#SBATCH").strip()
        for field, pattern in SIZE_OPTIONS.items():
            if pattern.match(option):
                problems.append(
                    Problem(
                        "slurm-setting-contradicts-plan",
                        [(f"hydra.launcher.extra_sbatch: {option}", COMMAND_LINE)],
                        f"The job's {field} come from the plan (cluster.nodes={cluster.nodes}, "
                        f"cluster.gpus_per_node={cluster.gpus_per_node}); a sbatch line cannot change them.",
                        _size_fix(field, option),
                    )
                )
    return problems


def _size_fix(field: str, option: str) -> str:
    number = re.search(r"(\d+)\s*$", option)
    if field.startswith("cluster.") and number:
        return f"{field}={number.group(1)} and drop the line"
    return "drop the line"


def with_executor(overrides: Sequence[str]) -> list[str]:
    """The job's overrides with the executor the launcher runs it with (added once, after the user's)."""
    return [*overrides, *(o for o in EXECUTOR_OVERRIDES if o not in overrides)]
