"""Training offload and optimizer storage, and what each leaves out for LoRA (docs/system.md §1.2 rules 9-15)."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import ADAPTERS, BACKEND, Finding, rule

NOT_BUILT = ("multi-lora-rollout-offload-not-built", "rollout-offload-engine-restarts-not-built")


@rule("disk-offload-needs-megatron")
def disk_offload_needs_megatron(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.offload_target != "disk":
        return
    if cfg.trainer.backend != "megatron":
        yield Finding(
            ("trainer.offload_target", BACKEND),
            "Offloading training state to disk is implemented by the Megatron backend only.",
            "trainer.offload_target=cpu",
        )
    if not d.offload_train:
        yield Finding(
            ("trainer.offload_target", "topology.offload_train"),
            "A disk offload target needs training offload to be on.",
            "topology.offload_train=true",
        )
    if cfg.trainer.offload_disk_chunk_mb <= 0:
        yield Finding(
            ("trainer.offload_disk_chunk_mb", "trainer.offload_target"),
            "Disk offload writes the trainer's state in chunks of this many MB; it must be positive.",
            "trainer.offload_disk_chunk_mb=64",
        )


@rule("streamed-optimizer-state-rejects-lora")
def streamed_optimizer_state_rejects_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.stream_optimizer_state_to_disk and d.lora_enabled:
        yield Finding(
            ("trainer.stream_optimizer_state_to_disk", ADAPTERS),
            "The LoRA checkpoint saves the optimizer state, which the disk stream leaves empty.",
            "trainer.stream_optimizer_state_to_disk=false",
        )


@rule("rematerialize-rejects-lora")
def rematerialize_rejects_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.rematerialize_param_from_master_weight and d.lora_enabled:
        yield Finding(
            ("trainer.rematerialize_param_from_master_weight", ADAPTERS),
            "Rematerializing parameters from master weights is not implemented for LoRA adapters.",
            "trainer.rematerialize_param_from_master_weight=false",
        )


@rule("offload-needs-megatron")
def offload_needs_megatron(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "megatron" or cfg.cluster.cpu_only or not d.offload_train:
        return
    yield Finding(
        ("topology.offload_train", BACKEND),
        "Training offload (the trainer's weights, gradients and optimizer state moved out while the engines "
        "generate) is the Megatron trainer's; the FSDP trainer stays resident. The engines' offload "
        "(topology.offload_rollout) works with either trainer.",
        "topology.offload_train=false",
    )


@rule("rollout-offload-needs-sync-schedule")
def rollout_offload_needs_sync_schedule(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.offload_rollout and cfg.rollout.schedule == "async":
        yield Finding(
            ("topology.offload_rollout", "rollout.schedule"),
            "The engines give their memory back between a rollout and the next push; under the async schedule "
            "they generate the next batch then, and SGLang releases memory only when idle.",
            "topology.offload_rollout=false",
        )


@rule("multi-lora-rollout-offload-not-built")
def multi_lora_rollout_offload_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.offload_rollout and d.multi_lora:
        yield Finding(
            ("topology.offload_rollout", ADAPTERS),
            "The multi-LoRA loop keeps its engines resident: it pushes adapters while others generate, so its "
            "engines are never idle between a rollout and a push.",
            "topology.offload_rollout=false",
        )


@rule("rollout-offload-engine-restarts-not-built")
def rollout_offload_engine_restarts_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.offload_rollout and cfg.executor.engine_restarts > 0:
        yield Finding(
            ("topology.offload_rollout", "executor.engine_restarts"),
            "An engine restarted while the others are released comes back holding its memory, and resuming a tag "
            "it never released fails (SGLang's scheduler raises); restarts under rollout offload are not built.",
            "executor.engine_restarts=0",
        )


@rule("optimizer-cpu-offload-needs-megatron")
def optimizer_cpu_offload_needs_megatron(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.optimizer.cpu_offload and cfg.trainer.backend != "megatron":
        yield Finding(
            ("optimizer.cpu_offload", BACKEND),
            "optimizer.cpu_offload is Megatron's CPU-offload optimizer (its state and step kept on the host); the "
            "FSDP trainer has no such switch: its optimizer state stays wherever its parameters are.",
            "optimizer.cpu_offload=false",
        )
