"""What a cluster can run: GPU-only components off a cpu-only cluster, the embedded engine's limits, FSDP
without model parallelism, and a trainer no larger than the cluster.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import BACKEND, Finding, rule


@rule("cpu-cluster-runs-no-gpu-components")
def cpu_cluster_runs_no_gpu_components(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.cluster.cpu_only:
        return
    if cfg.engine.kind == "sglang":
        yield Finding(
            ("engine.kind", "cluster.cpu_only"),
            "SGLang servers need CUDA GPUs; a cpu-only cluster runs the embedded engine.",
            "engine=embedded",
        )
    if cfg.cluster.gpu_type != "none" or cfg.cluster.gpu_memory_gb > 0:
        yield Finding(
            ("cluster.gpu_type", "cluster.gpu_memory_gb", "cluster.cpu_only"),
            "A cpu-only cluster has no GPUs to describe.",
            "cluster.gpu_type=none cluster.gpu_memory_gb=0",
        )


@rule("gpu-cluster-needs-gpus", precondition=True)
def gpu_cluster_needs_gpus(cfg: MilesConfig, d: Derived | None) -> Iterator[Finding]:
    if not cfg.cluster.cpu_only and cfg.cluster.gpus_per_node <= 0:
        yield Finding(
            ("cluster.gpus_per_node", "cluster.cpu_only"),
            "A GPU cluster needs at least one GPU per node.",
            "cluster.gpus_per_node=8",
        )


@rule("embedded-engine-model-too-large")
def embedded_engine_model_too_large(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind == "embedded" and cfg.model.params_b > cfg.engine.embedded_max_params_b:
        yield Finding(
            ("engine.kind", "model.params_b"),
            f"The embedded CPU engine serves up to {cfg.engine.embedded_max_params_b}B parameters; "
            f"{cfg.model.name} has {cfg.model.params_b}B.",
            "model=tiny_moe" if cfg.cluster.cpu_only else "engine=sglang",
        )


@rule("embedded-engine-is-one-process")
def embedded_engine_is_one_process(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind == "embedded" and (cfg.engine.tp_size != 1 or cfg.engine.ep_size != 1):
        yield Finding(
            ("engine.kind", "engine.tp_size", "engine.ep_size"),
            "The embedded engine is a single process: it has no tensor or expert parallelism.",
            "engine.tp_size=1 engine.ep_size=1",
        )


@rule("fsdp-has-no-model-parallelism")
def fsdp_has_no_model_parallelism(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    p = cfg.trainer.parallel
    if cfg.trainer.backend == "fsdp":
        for key in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(p, key) != 1:
                yield Finding(
                    (BACKEND, f"trainer.parallel.{key}"),
                    "The FSDP trainer shards data-parallel only; model parallelism is Megatron's.",
                    f"trainer.parallel.{key}=1",
                )


@rule("trainer-fits-cluster")
def trainer_fits_cluster(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    t = cfg.topology
    if t.actor_num_nodes > cfg.cluster.nodes:
        yield Finding(
            ("topology.actor_num_nodes", "cluster.nodes"),
            f"The trainer asks for {t.actor_num_nodes} nodes; the cluster has {cfg.cluster.nodes}.",
            f"topology.actor_num_nodes={cfg.cluster.nodes}",
        )
    if d.trainer_gpus_per_node > d.devices_per_node:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "cluster.gpus_per_node"),
            f"The trainer asks for {d.trainer_gpus_per_node} GPUs per node; nodes have {d.devices_per_node}.",
            f"topology.actor_num_gpus_per_node={d.devices_per_node}",
        )


@rule("host-memory-holds-cpu-plan")
def host_memory_holds_cpu_plan(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """On a cpu-only cluster every engine and trainer rank is a process holding the fp32 weights (~4 GB per
    billion parameters) in the node's memory."""
    if not cfg.cluster.cpu_only:
        return
    processes = -(-d.num_engines // cfg.cluster.nodes) + d.trainer_gpus_per_node
    need = processes * cfg.model.params_b * 4
    if need > cfg.cluster.memory_gb_per_node:
        yield Finding(
            ("cluster.memory_gb_per_node", "model.params_b"),
            f"{processes} processes per node would hold {need:.1f} GB of fp32 weights; a node has "
            f"{cfg.cluster.memory_gb_per_node:g} GB.",
            f"cluster.memory_gb_per_node={need * 1.5:.3g}",
        )
