"""Every count (processes, GPUs, samples, restarts) is at least 1 or 0: a precondition, since later rules
divide by these sizes.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig, lookup
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import Finding, rule

POSITIVE_SIZES = (
    "cluster.nodes",
    "trainer.parallel.tp",
    "trainer.parallel.pp",
    "trainer.parallel.cp",
    "trainer.parallel.ep",
    "trainer.parallel.etp",
    "trainer.parallel.micro_batch_size",
    "engine.tp_size",
    "engine.ep_size",
)
NON_NEGATIVE_SIZES = (
    "cluster.gpus_per_node",
    "cluster.cpu_devices_per_node",
    "topology.actor_num_nodes",
    "topology.actor_num_gpus_per_node",
    "topology.rollout_num_gpus",
    "algorithm.global_batch_size",
    "adapters.max_slots",
    "engine.max_lora_rank",
    "executor.engine_restarts",
)


@rule("sizes-positive", precondition=True)
def sizes_positive(cfg: MilesConfig, d: Derived | None) -> Iterator[Finding]:
    for key in POSITIVE_SIZES + NON_NEGATIVE_SIZES:
        value, least = lookup(cfg, key), 1 if key in POSITIVE_SIZES else 0
        if value < least:
            yield Finding(
                (key,),
                f"{key} is a count (of processes, GPUs, samples or restarts); it must be at least {least}.",
                f"{key}={least}",
            )
    if cfg.cluster.cpu_only and cfg.cluster.cpu_devices_per_node < 1:
        yield Finding(
            ("cluster.cpu_devices_per_node",),
            "A cpu-only node needs at least one device (CPU worker process).",
            "cluster.cpu_devices_per_node=1",
        )
