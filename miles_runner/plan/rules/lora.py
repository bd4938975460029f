"""LoRA modes against the trainer backend, topology and model, and the adapter's rank and target modules
(docs/system.md §1.2 rules 18-25).
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.loader import did_you_mean
from miles_runner.config.schema import MilesConfig
from miles_runner.core.targets import ALL_ALIASES, KNOWN_MODULES, absent_modules, is_known_module
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import ADAPTERS, BACKEND, LORA_MODE, TOPOLOGY, Finding, rule
from miles_runner.plan.starting_adapter import starting_adapter_problems


@rule("lora-mode-needs-adapters")
def lora_mode_needs_adapters(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.lora_mode != "none" and not d.lora_enabled:
        yield Finding(
            (LORA_MODE, ADAPTERS),
            "A LoRA mode without adapters trains nothing LoRA-shaped; full-weight training is lora_mode=none.",
            "lora_mode=none",
        )


@rule("adapters-need-lora-mode")
def adapters_need_lora_mode(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and cfg.trainer.lora_mode == "none":
        fix = "lora_mode=bridge" if cfg.trainer.backend == "megatron" else "lora_mode=peft"
        yield Finding((ADAPTERS, LORA_MODE), "Adapters are configured but no LoRA implementation is chosen.", fix)


@rule("lora-mode-matches-trainer")
def lora_mode_matches_trainer(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode, backend = cfg.trainer.lora_mode, cfg.trainer.backend
    if mode in ("bridge", "raw") and backend != "megatron":
        yield Finding((LORA_MODE, BACKEND), f"lora_mode={mode} is a Megatron path.", "lora_mode=peft")
    if mode == "peft" and backend != "fsdp":
        yield Finding((LORA_MODE, BACKEND), "lora_mode=peft is the FSDP trainer's path.", "lora_mode=bridge")


@rule("disaggregated-lora-needs-bridge")
def disaggregated_lora_needs_bridge(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not d.colocated and cfg.trainer.lora_mode == "raw":
        yield Finding(
            (TOPOLOGY, LORA_MODE),
            "Broadcasting an adapter to separate engines needs the bridge export; raw LoRA syncs colocated only.",
            "lora_mode=bridge",
        )


@rule("disaggregated-lora-needs-pp1")
def disaggregated_lora_needs_pp1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not d.colocated and cfg.trainer.parallel.pp > 1:
        yield Finding(
            (TOPOLOGY, "trainer.parallel.pp"),
            "With pipeline stages no single rank holds the full adapter to broadcast.",
            "trainer.parallel.pp=1",
        )


@rule("ppo-critic-rejects-bridge")
def ppo_critic_rejects_bridge(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.algorithm.advantage_estimator == "ppo" and cfg.trainer.lora_mode == "bridge":
        yield Finding(
            ("algorithm.advantage_estimator", LORA_MODE),
            "The PPO critic cannot be built through the bridge LoRA path.",
            "algorithm.advantage_estimator=grpo",
        )


@rule("lora-rank-positive")
def lora_rank_positive(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and cfg.adapters.rank <= 0:
        yield Finding(("adapters.rank",), "A LoRA adapter needs a rank of at least 1.", "adapters.rank=16")
    if d.lora_enabled and cfg.adapters.alpha <= 0:
        yield Finding(("adapters.alpha",), "LoRA alpha scales the update and must be positive.", "adapters.alpha=32")


@rule("lora-targets-required")
def lora_targets_required(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not cfg.adapters.target_modules:
        yield Finding(
            ("adapters.target_modules",),
            "'target_modules' is required when LoRA is enabled: it says which layers get adapters.",
            "adapters.target_modules=[all-linear]",
        )
    elif d.lora_enabled and not d.target_modules:
        yield Finding(
            ("adapters.target_modules", "adapters.exclude_modules"),
            "The exclusions remove every target module; the adapter would be empty.",
            "adapters.exclude_modules=[]",
        )


@rule("lora-target-unknown")
def lora_target_unknown(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.lora_enabled:
        return
    for name in cfg.adapters.target_modules:
        if not is_known_module(name):
            hint = did_you_mean(name, sorted(KNOWN_MODULES) + list(ALL_ALIASES))
            yield Finding(
                ("adapters.target_modules",),
                f"'{name}' is not a linear module name a model defines; {hint or 'use all-linear or HF names'}",
                "adapters.target_modules=[all-linear]",
            )


@rule("lora-target-not-in-model")
def lora_target_not_in_model(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """A named attention linear the model's attention does not have would be matched by nothing: the adapter
    would silently leave it out (an MLA model has no k_proj; a standard one no kv_b_proj)."""
    if not d.lora_enabled:
        return
    m = cfg.model
    absent = absent_modules(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank)
    if missing := [name for name in cfg.adapters.target_modules if name in absent]:
        attention = "MLA" if m.kv_lora_rank else "standard (q, k, v, o)"
        kept = [name for name in cfg.adapters.target_modules if name not in absent]
        yield Finding(
            ("adapters.target_modules", "model.kv_lora_rank", "model.q_lora_rank"),
            f"{m.name} has {attention} attention, without {', '.join(missing)}.",
            f"adapters.target_modules=[{','.join(kept or ['all-linear'])}]",
        )


@rule("starting-adapter-fits-plan")
def starting_adapter_fits_plan(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    path = cfg.adapters.path
    if not path:
        return
    if cfg.adapters.kind != "single":
        yield Finding(
            ("adapters.path", ADAPTERS),
            "adapters.path is the one adapter a single-adapter run starts from; multi-LoRA adapters start fresh.",
            "adapters.path=''",
        )
        return
    a = cfg.adapters
    for problem in starting_adapter_problems(
        path, rank=a.rank, alpha=a.alpha, targets=d.target_modules, base=d.model_path
    ):
        yield Finding(
            ("adapters.path", "adapters.rank", "adapters.alpha", "adapters.target_modules", "model.path"),
            f"The starting adapter cannot be loaded as planned: {problem}.",
            "adapters.path=''",
        )
