"""The Slurm launcher's settings (`hydra.launcher.*` under `hydra/launcher=miles_slurm`).

What a job needs in nodes and GPUs comes from the plan only (cluster.nodes, cluster.gpus_per_node): `nodes`,
`gpus_per_node` and `tasks_per_node` exist so a submitit-style habit is caught, and any value other than the
plan's is a plan error (slurm/contradictions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from miles_runner.core.errors import PlanError, Problem


@dataclass
class SlurmSettings:
    partition: str = ""  # empty: the cluster's default partition
    account: str = ""
    qos: str = ""
    time: str = ""  # Slurm's --time (e.g. 4:00:00); empty: the partition's limit
    cpus_per_task: int = 0  # per node (one task per node); 0: the partition's default
    mem: str = ""  # per node, Slurm's --mem (e.g. 64G; 0 is the whole node); empty: the partition's default
    job_name: str = ""  # empty: miles-<run.name>
    setup: list[str] = field(default_factory=list)  # shell lines run first (module load, conda activate, ...)
    srun_args: list[str] = field(default_factory=list)  # added to every srun (e.g. pyxis --container-image=...)
    extra_sbatch: list[str] = field(default_factory=list)  # more #SBATCH options, e.g. --constraint=h100
    requeue: bool = True  # --requeue: a preempted or requeued job resumes from its last checkpoint
    wait: bool = False  # block until every job ended and return their results; default: submit and exit
    nodes_timeout_s: int = 300  # how long the job waits for every node's Ray before it fails, naming the missing
    python: str = ""  # the interpreter on the nodes; empty: the one that submits
    poll_interval_s: float = 5.0  # wait=true: how often job states are read
    # Only the plan decides these; set here they must equal it.
    nodes: int | None = None
    gpus_per_node: int | None = None
    tasks_per_node: int | None = None


SETTING_NAMES = tuple(f.name for f in fields(SlurmSettings))


def settings_from(mapping: Any) -> SlurmSettings:
    """SlurmSettings from Hydra's `hydra.launcher` node (or any mapping); `_target_` is Hydra's."""
    values = {k: v for k, v in dict(mapping).items() if k != "_target_"}
    unknown = sorted(set(values) - set(SETTING_NAMES))
    if unknown:
        raise PlanError(
            [
                Problem(
                    "slurm-setting-unknown",
                    [(f"hydra.launcher.{k}", "command line") for k in unknown],
                    f"hydra/launcher=miles_slurm has no such setting; its settings are {', '.join(SETTING_NAMES)}.",
                    "drop it, or use one of those",
                )
            ]
        )
    values = {
        k: list(v) if isinstance(v, list | tuple) or type(v).__name__ == "ListConfig" else v for k, v in values.items()
    }
    return SlurmSettings(**values)


def settings_from_overrides(overrides: list[str]) -> SlurmSettings:
    """The settings the command line's hydra.launcher.* overrides give (what `--plan` renders with, before Hydra
    composes the launcher's node); values are parsed as Hydra parses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    prefix = "hydra.launcher."
    chosen = [o for o in overrides if o.lstrip("+").startswith(prefix)]
    parsed = OverridesParser.create().parse_overrides(chosen)
    return settings_from({o.key_or_group.removeprefix(prefix): o.value() for o in parsed})
