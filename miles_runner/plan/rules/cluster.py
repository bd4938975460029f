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
    if cfg.trainer.backend == "megatron":
        yield Finding(
            (BACKEND, "cluster.cpu_only"),
            "The Megatron trainer needs CUDA GPUs; a cpu-only cluster trains with FSDP.",
            "trainer=fsdp lora_mode=peft",
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
    if d.trainer_gpus_per_node > d.slots_per_node:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "cluster.gpus_per_node"),
            f"The trainer asks for {d.trainer_gpus_per_node} GPUs per node; nodes have {d.slots_per_node}.",
            f"topology.actor_num_gpus_per_node={d.slots_per_node}",
        )
