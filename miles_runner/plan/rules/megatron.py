"""What the Megatron trainer (trainer=megatron) builds: its LoRA paths against the model family, the fused
target groups, the parallel layouts it runs, and the Megatron settings this release refuses rather than ignores.

lora_mode=raw is the project's own LoRA on megatron-core (trainer/megatron/raw_lora.py), for the families with a
converter; lora_mode=bridge is Megatron-Bridge's AutoBridge and PEFT LoRA, for the model types Bridge registers.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.core.megatron_families import (
    BRIDGE_MODEL_TYPES,
    FUSED_TARGET_GROUPS,
    RAW_LORA_FAMILIES,
    hf_model_type,
)
from miles_runner.plan.derive import Derived, parse_tiny_model
from miles_runner.plan.model_shape import checkpoint_config
from miles_runner.plan.rules.base import ADAPTERS, BACKEND, LORA_MODE, Finding, rule

EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")
NOT_BUILT = (
    "megatron-cpu-dsa-tensor-parallel-not-built",
    "megatron-lora-layout-not-built",
    "megatron-parallelism-not-built",
)


def _megatron_lora(cfg: MilesConfig, d: Derived) -> bool:
    return cfg.trainer.backend == "megatron" and d.lora_enabled


@rule("raw-lora-needs-converter")
def raw_lora_needs_converter(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    family = cfg.model.family
    if _megatron_lora(cfg, d) and cfg.trainer.lora_mode == "raw" and family not in RAW_LORA_FAMILIES:
        bridge = hf_model_type(family) in BRIDGE_MODEL_TYPES
        yield Finding(
            (LORA_MODE, "model.family"),
            f"lora_mode=raw converts {', '.join(RAW_LORA_FAMILIES)} between Hugging Face and megatron-core; "
            f"{family} has no converter" + ("; Megatron-Bridge builds it." if bridge else "."),
            "lora_mode=bridge" if bridge else "trainer=fsdp lora_mode=peft",
        )


@rule("native-lora-model-not-supported")
def native_lora_model_not_supported(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "megatron" and cfg.model.native_lora:
        yield Finding(
            ("model.native_lora", LORA_MODE),
            "No supported model ships its own LoRA modules (miles' Inkling provider); lora_mode=raw attaches the "
            "project's LoRA to megatron-core's linears instead.",
            "model.native_lora=false",
        )


@rule("megatron-lora-fused-targets")
def megatron_lora_fused_targets(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not _megatron_lora(cfg, d) or cfg.adapters.lora_type != "lora":
        return
    targets = set(d.target_modules)
    # MLA attention (kv_lora_rank > 0) has no linear_qkv: its query and key-value projections are separate linears.
    mla = cfg.model.kv_lora_rank > 0
    for group in (g for g in FUSED_TARGET_GROUPS if not (mla and "q_proj" in g)):
        named = [m for m in group if m in targets]
        if named and len(named) < len(group):
            fix = f"adapters.target_modules=[{','.join(sorted(targets | set(group)))}]"
            exclude = cfg.adapters.exclude_modules
            kept = [m for m in exclude if m not in group]  # an excluded member would be dropped again
            yield Finding(
                ("adapters.target_modules", *(("adapters.exclude_modules",) if kept != exclude else ()), BACKEND),
                f"Megatron fuses {', '.join(group)} into one linear, which takes one LoRA: targeting "
                f"{', '.join(named)} alone would adapt all of them.",
                fix + (f" adapters.exclude_modules=[{','.join(kept)}]" if kept != exclude else ""),
            )


@rule("bridge-supports-model")
def bridge_supports_model(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    model_type = hf_model_type(cfg.model.family)
    if cfg.trainer.backend == "megatron" and cfg.trainer.lora_mode == "bridge" and model_type not in BRIDGE_MODEL_TYPES:
        yield Finding(
            ("model.family", LORA_MODE),
            f"Megatron-Bridge 0.6.2 registers no bridge for the Hugging Face model type {model_type!r}.",
            "trainer=fsdp lora_mode=peft",
        )


@rule("bridge-expert-lora-needs-ep1")
def bridge_expert_lora_needs_ep1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    p = cfg.trainer.parallel
    experts = [m for m in d.target_modules if m in EXPERT_TARGETS]
    if _megatron_lora(cfg, d) and cfg.trainer.lora_mode == "bridge" and d.is_moe and experts and p.ep > 1:
        yield Finding(
            ("adapters.target_modules", "trainer.parallel.ep", LORA_MODE),
            "Megatron-Bridge 0.6.2 exports expert LoRA wrongly with EP > 1: each rank writes only its local "
            f"experts, numbered from 0, so the adapter of [{', '.join(experts)}] would not load (PEFT refuses it).",
            "trainer.parallel.ep=1",
        )


@rule("megatron-lora-layout-not-built")
def megatron_lora_layout_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not _megatron_lora(cfg, d):
        return
    if cfg.adapters.lora_type != "lora":
        yield Finding(
            ("adapters.lora_type", BACKEND),
            "canonical_lora (one LoRA per projection of the fused linears) is not built in this release; the "
            "Megatron trainer trains one LoRA per fused linear, exported as PEFT per-projection tensors.",
            "adapters.lora_type=lora",
        )
    if cfg.adapters.experts_shared_outer:
        yield Finding(
            ("adapters.experts_shared_outer", BACKEND),
            "Shared-outer expert LoRA is not built in this release: the Megatron trainer trains one LoRA per expert.",
            "adapters.experts_shared_outer=false",
        )


@rule("bridge-multi-lora-needs-converter")
def bridge_multi_lora_needs_converter(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """miles' Megatron multi-LoRA is Megatron-Bridge's MultiLoRA, which no release up to the pinned 0.6.2 has; here
    the slots are raw LoRA slots on Bridge's model, exported in PEFT names by the project's converter, which names
    the raw LoRA families only (trainer/megatron/multi_lora.py)."""
    family = cfg.model.family
    if (
        _megatron_lora(cfg, d)
        and d.multi_lora
        and cfg.trainer.lora_mode == "bridge"
        and family not in RAW_LORA_FAMILIES
    ):
        yield Finding(
            (BACKEND, ADAPTERS, "model.family"),
            f"Megatron multi-LoRA slots export through the project's converter, which has no {family} names "
            f"(it has {', '.join(sorted(RAW_LORA_FAMILIES))}); Megatron-Bridge 0.6.2 has no MultiLoRA of its own.",
            "trainer=fsdp lora_mode=peft",
        )


@rule("megatron-parallelism-not-built")
def megatron_parallelism_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend != "megatron":
        return
    p = cfg.trainer.parallel
    reasons = {
        "pp": "pipeline stages",
        "cp": "context parallelism (ring attention needs Transformer Engine)",
        "etp": "expert tensor parallelism",
    }
    for key, what in reasons.items():
        if getattr(p, key) != 1:
            yield Finding(
                (f"trainer.parallel.{key}", BACKEND),
                f"The Megatron trainer of this release runs TP, EP and DP (with sequence parallelism under TP); "
                f"{what} are not built.",
                f"trainer.parallel.{key}=1",
            )


@rule("tensor-parallel-divides-heads")
def tensor_parallel_divides_heads(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """Megatron splits attention heads and KV groups (num_query_groups) over TP; the KV heads come from the
    checkpoint's config when it is on this machine (the model.* description has no such field)."""
    tp = cfg.trainer.parallel.tp
    if cfg.trainer.backend != "megatron" or tp <= 0:
        return
    tiny = parse_tiny_model(cfg.model.path)
    config = checkpoint_config(d.model_path, tiny[0] if tiny else None) or {}
    counts = {"attention heads": cfg.model.num_attention_heads}
    if config.get("num_key_value_heads"):
        counts["KV heads"] = int(config["num_key_value_heads"])
    for what, count in counts.items():
        if count % tp:
            fitting = max(t for t in range(1, tp + 1) if all(n % t == 0 for n in counts.values()))
            yield Finding(
                ("trainer.parallel.tp", "model.num_attention_heads", "model.path"),
                f"TP {tp} splits attention by heads and KV groups; {cfg.model.name} has {count} {what}.",
                f"trainer.parallel.tp={fitting}",
            )
            return


@rule("megatron-cpu-dsa-tensor-parallel-not-built")
def megatron_cpu_dsa_tensor_parallel_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """Without Transformer Engine (a CPU host) the DSA indexer's replicated linears stand in as column-parallel ones
    (trainer/megatron/bridge_compat.py), which are replicated only at TP 1."""
    dsa_on_cpu = cfg.cluster.cpu_only and cfg.trainer.backend == "megatron" and cfg.model.has_dsa_indexer
    if dsa_on_cpu and cfg.trainer.parallel.tp > 1:
        yield Finding(
            ("trainer.parallel.tp", "model.has_dsa_indexer", "cluster.cpu_only"),
            "On a CPU host the Megatron trainer builds DSA attention (GLM-5's) at tensor parallel size 1 only.",
            "trainer.parallel.tp=1",
        )


@rule("optimizer-cpu-offload-needs-adam-or-sgd")
def optimizer_cpu_offload_needs_adam_or_sgd(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """Megatron's HybridDeviceOptimizer steps torch's AdamW or SGD on the host copies (megatron-core's
    get_megatron_optimizer), nothing else."""
    if cfg.optimizer.cpu_offload and cfg.optimizer.name not in ("adam", "sgd"):
        yield Finding(
            ("optimizer.cpu_offload", "optimizer.name"),
            f"Megatron's CPU-offloaded optimizer runs adam or sgd, not {cfg.optimizer.name}.",
            "optimizer.name=adam",
        )


@rule("bridge-cannot-start-from-adapter")
def bridge_cannot_start_from_adapter(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if _megatron_lora(cfg, d) and cfg.trainer.lora_mode == "bridge" and cfg.adapters.path:
        yield Finding(
            ("adapters.path", LORA_MODE),
            "Megatron-Bridge 0.6.2 exports PEFT adapters but cannot import one into its LoRA modules.",
            "lora_mode=raw",
        )
