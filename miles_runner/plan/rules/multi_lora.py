"""Multi-LoRA: the training setup per-adapter slots need, and each adapter's name, rank, targets and batch
shape (spec §1.2 rules 26-29).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.core.adapters import adapter_name_problem
from miles_runner.plan.derive import Derived, adapter_value, min_groups_per_dp_split, resolved_targets
from miles_runner.plan.rules.base import ADAPTERS, LORA_MODE, TOPOLOGY, Finding, RuleFn, rule


def _multi(fn: RuleFn) -> RuleFn:
    def wrapped(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
        if d.multi_lora:
            yield from fn(cfg, d)

    return wrapped


@rule("multi-lora-needs-disaggregated")
@_multi
def multi_lora_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.colocated:
        yield Finding(
            (ADAPTERS, TOPOLOGY),
            "Multi-LoRA adapters reach the engines only by broadcast to engines that keep running "
            "(disaggregated).",
            "topology=disaggregated",
        )


@rule("multi-lora-needs-slotted-lora")
@_multi
def multi_lora_needs_slotted_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.lora.mode not in ("bridge", "peft"):
        yield Finding(
            (ADAPTERS, LORA_MODE),
            "Per-adapter slots exist in the bridge PEFT path (Megatron) and the peft path (FSDP) only.",
            "lora_mode=bridge" if cfg.trainer.backend == "megatron" else "lora_mode=peft",
        )


@rule("multi-lora-needs-pp1")
@_multi
def multi_lora_needs_pp1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.parallel.pp > 1:
        yield Finding(
            (ADAPTERS, "trainer.parallel.pp"),
            "No pipeline rank holds a full adapter, and a pipelined recompute would use another "
            "micro-batch's routing.",
            "trainer.parallel.pp=1",
        )


@rule("multi-lora-needs-adam")
@_multi
def multi_lora_needs_adam(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.optimizer.name != "adam":
        yield Finding(
            (ADAPTERS, "optimizer.name"),
            "Per-slot optimizer state (and its reset when a slot is reused) is implemented for Adam only.",
            "optimizer.name=adam",
        )


@rule("multi-lora-needs-thd")
@_multi
def multi_lora_needs_thd(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "megatron" and cfg.trainer.parallel.qkv_format != "thd":
        yield Finding(
            (ADAPTERS, "trainer.parallel.qkv_format"),
            "Per-adapter token spans need contiguous (thd) packing.",
            "trainer.parallel.qkv_format=thd",
        )


@rule("multi-lora-keeps-gradients-resident")
@_multi
def multi_lora_keeps_gradients_resident(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.offload_train:
        yield Finding(
            (ADAPTERS, "topology.offload_train"),
            "Per-adapter gradients stay in device buffers between train calls; training offload would drop them.",
            "topology.offload_train=false",
        )


@rule("multi-lora-no-shared-outer-experts")
@_multi
def multi_lora_no_shared_outer_experts(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.adapters.experts_shared_outer:
        yield Finding(
            (ADAPTERS, "adapters.experts_shared_outer"),
            "Shared-outer expert LoRA has no per-slot layout.",
            "adapters.experts_shared_outer=false",
        )


@rule("multi-lora-per-adapter-loss")
@_multi
def multi_lora_per_adapter_loss(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.calculate_per_token_loss:
        yield Finding(
            (ADAPTERS, "trainer.calculate_per_token_loss"),
            "The loss is normalised per adapter batch; a per-token loss would mix adapters.",
            "trainer.calculate_per_token_loss=false",
        )


@rule("multi-lora-needs-adapters")
@_multi
def multi_lora_needs_adapters(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.adapters.runs and not cfg.adapters.service_mode:
        yield Finding(
            ("adapters.runs", "adapters.service_mode"),
            "A bounded multi-LoRA run with no adapters has nothing to train.",
            "adapters.service_mode=true",
        )
    if d.multi_lora_slots < 1 and cfg.adapters.service_mode:
        yield Finding(
            ("adapters.max_slots", "adapters.service_mode"),
            "A multi-LoRA service with no configured adapters needs engine slots for the ones that will register.",
            "adapters.max_slots=4",
        )
    if cfg.adapters.max_slots and len(cfg.adapters.runs) > cfg.adapters.max_slots:
        yield Finding(
            ("adapters.runs", "adapters.max_slots"),
            f"{len(cfg.adapters.runs)} adapters do not fit in {cfg.adapters.max_slots} engine slots.",
            f"adapters.max_slots={len(cfg.adapters.runs)}",
        )


@rule("adapter-names-unique-and-safe")
def adapter_names_unique_and_safe(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.multi_lora:
        return
    counts = Counter(run.name for run in cfg.adapters.runs)
    for i, run in enumerate(cfg.adapters.runs):
        if problem := adapter_name_problem(run.name):
            yield Finding((f"adapters.runs[{i}].name",), f"Adapter names become folders and rid prefixes: {problem}.")
        elif counts[run.name] > 1:
            yield Finding((f"adapters.runs[{i}].name",), f"'{run.name}' names more than one adapter.")


@rule("adapter-fits-engine")
@_multi
def adapter_fits_engine(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    served = set(d.target_modules)
    for i, run in enumerate(cfg.adapters.runs):
        rank = adapter_value(run, "rank", cfg)
        if rank <= 0 or rank > d.max_lora_rank:
            yield Finding(
                (f"adapters.runs[{i}].rank", "engine.max_lora_rank"),
                f"Adapter '{run.name}' has rank {rank}; engines serve ranks 1..{d.max_lora_rank}.",
                f"engine.max_lora_rank={rank}" if rank > 0 else f"++adapters.runs.{i}.rank=1",
            )
        extra = [m for m in resolved_targets(cfg, adapter_value(run, "target_modules", cfg)) if m not in served]
        if extra:
            yield Finding(
                (f"adapters.runs[{i}].target_modules", "adapters.target_modules"),
                f"Adapter '{run.name}' targets {extra}, which the engines are not launched to serve.",
                "adapters.target_modules=[all-linear]",
            )


@rule("adapter-batch-shape")
@_multi
def adapter_batch_shape(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    cap = 4 * d.global_batch_size
    for i, run in enumerate(cfg.adapters.runs):
        rbs = adapter_value(run, "rollout_batch_size", cfg)
        n = adapter_value(run, "n_samples_per_prompt", cfg)
        keys = (f"adapters.runs[{i}].rollout_batch_size", f"adapters.runs[{i}].n_samples_per_prompt")
        if rbs < 1 or n < 1:
            yield Finding(keys, f"Adapter '{run.name}' needs at least one prompt and one sample per prompt.")
            continue
        if rbs * n > cap:
            yield Finding(keys, f"Adapter '{run.name}': {rbs}x{n} samples exceed the cap of 4 x global batch ({cap}).")
        split = min_groups_per_dp_split(n, d.dp_size)
        if d.dp_size and split is None:
            yield Finding(keys, f"Adapter '{run.name}': {n} samples per prompt and DP {d.dp_size} do not divide.")
        elif split and rbs % split:
            reason = f"Adapter '{run.name}': {rbs} prompts is not a multiple of {split} groups per DP split."
            yield Finding(keys, reason)
