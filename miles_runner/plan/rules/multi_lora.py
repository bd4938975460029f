"""Multi-LoRA: the training setup per-adapter slots need, and each adapter's name, rank, targets and batch
shape (docs/system.md §1.2 rules 26-29).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

from miles_runner.config.schema import AdapterEntry, MilesConfig
from miles_runner.core.adapters import (
    AdapterLimits,
    AdapterProblem,
    adapter_name_problem,
    adapter_problems,
    min_groups_per_dp_split,
)
from miles_runner.plan.derive import Derived, adapter_value, adapter_values
from miles_runner.plan.rules.base import ADAPTERS, LORA_MODE, TOPOLOGY, Finding, RuleFn, rule
from miles_runner.plugins.lookup import registered


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
            "Multi-LoRA adapters reach the engines only by broadcast to engines that keep running (disaggregated).",
            "topology=disaggregated",
        )


@rule("multi-lora-needs-slotted-lora")
@_multi
def multi_lora_needs_slotted_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """miles forces megatron_to_hf_mode=bridge because its slots are Megatron-Bridge's MultiLoRA; here the raw LoRA
    has slots of its own (trainer/megatron/multi_lora.py), so Megatron takes raw too."""
    if cfg.trainer.lora_mode not in ("bridge", "raw", "peft"):
        yield Finding(
            (ADAPTERS, LORA_MODE),
            "Per-adapter slots exist in the Megatron LoRA paths (raw, bridge) and the peft path (FSDP) only.",
            "lora_mode=raw" if cfg.trainer.backend == "megatron" else "lora_mode=peft",
        )


@rule("multi-lora-needs-pp1")
@_multi
def multi_lora_needs_pp1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.parallel.pp > 1:
        yield Finding(
            (ADAPTERS, "trainer.parallel.pp"),
            "No pipeline rank holds a full adapter, and a pipelined recompute would use another micro-batch's routing.",
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


def adapter_limits(d: Derived) -> AdapterLimits:
    """What the plan's engines and trainer serve, as the multi-LoRA controller will check it at run time."""
    names = registered()
    return AdapterLimits(
        max_slots=d.multi_lora_slots,
        max_lora_rank=d.max_lora_rank,
        target_modules=tuple(d.target_modules),
        max_adapter_global_batch_size=d.max_adapter_global_batch_size,
        dp_size=d.dp_size,
        tasks=tuple(names["task"]),
        rewards=tuple(names["reward"]),
        agents=tuple(names["agent"]),
    )


def _problems(cfg: MilesConfig, d: Derived, fields: set[str]) -> Iterator[tuple[int, AdapterEntry, AdapterProblem]]:
    """Each configured adapter's problems from the one adapter check, limited to the given fields."""
    limits = adapter_limits(d)
    for i, run in enumerate(cfg.adapters.runs):
        for problem in adapter_problems(run.name, adapter_values(cfg, run), limits):
            if fields & set(problem.fields):
                yield i, run, problem


def _keys(i: int, problem: AdapterProblem) -> tuple[str, ...]:
    return tuple(f"adapters.runs[{i}].{field}" for field in problem.fields)


@rule("adapter-names-unique-and-safe")
@_multi
def adapter_names_unique_and_safe(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    names = [run.name for run in cfg.adapters.runs]
    counts, named = Counter(names), set()
    for i, _run, problem in _problems(cfg, d, {"name"}):
        named.add(i)
        yield Finding(
            _keys(i, problem),
            f"Adapter names become folders and rid prefixes: {problem}.",
            f"++adapters.runs.{i}.name={free_name(names, i)}",
        )
    for i, name in enumerate(names):
        if i not in named and counts[name] > 1 and names.index(name) != i:  # the first keeps its name
            yield Finding(
                (f"adapters.runs[{i}].name",),
                f"'{name}' names more than one adapter.",
                f"++adapters.runs.{i}.name={free_name(names, i)}",
            )


def free_name(names: list[str], i: int) -> str:
    """A valid name for adapter i that no other adapter has: its own name made safe, numbered if taken."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", names[i]).strip(".-_") or "adapter"
    if adapter_name_problem(base):  # reserved (a slot name, miles_lora)
        base = f"adapter-{base.strip('_')}"
    taken = set(names[:i] + names[i + 1 :])
    return next(c for c in (base, *(f"{base}-{k}" for k in range(2, len(names) + 2))) if c not in taken)


@rule("adapter-fits-engine")
@_multi
def adapter_fits_engine(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    for i, run, problem in _problems(cfg, d, {"rank", "alpha", "lr", "target_modules"}):
        field = problem.fields[0]
        if field == "rank":
            rank = adapter_value(run, "rank", cfg)
            fits = isinstance(rank, int) and rank > 0
            yield Finding(
                (*_keys(i, problem), "engine.max_lora_rank"),
                f"Adapter '{run.name}': {problem}.",
                f"engine.max_lora_rank={rank}" if fits else f"++adapters.runs.{i}.rank=1",
            )
        elif field == "target_modules":
            yield Finding(
                (*_keys(i, problem), "adapters.target_modules"),
                f"Adapter '{run.name}': {problem}.",
                "adapters.target_modules=[all-linear]",
            )
        else:
            yield Finding(_keys(i, problem), f"Adapter '{run.name}': {problem}.", f"++adapters.runs.{i}.{field}=...")


@rule("adapter-batch-shape")
@_multi
def adapter_batch_shape(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    fields = {"rollout_batch_size", "n_samples_per_prompt", "num_step", "num_epoch"}
    limits = adapter_limits(d)
    for i, run, problem in _problems(cfg, d, fields):
        yield Finding(
            _keys(i, problem),
            f"Adapter '{run.name}': {problem}.",
            batch_fix(i, adapter_values(cfg, run), limits, problem),
        )


def batch_fix(i: int, values: dict[str, Any], limits: AdapterLimits, problem: AdapterProblem) -> str:
    """Overrides that give adapter i a batch shape the check accepts (a count that is unset when invalid)."""
    if problem.fields[0] in ("num_step", "num_epoch"):
        return f"++adapters.runs.{i}.{problem.fields[0]}=null"
    rbs, n = fitting_batch(values["rollout_batch_size"], values["n_samples_per_prompt"], limits)
    changed = {"rollout_batch_size": rbs, "n_samples_per_prompt": n}
    return " ".join(f"++adapters.runs.{i}.{key}={value}" for key, value in changed.items() if value != values[key])


def fitting_batch(rbs: Any, n: Any, limits: AdapterLimits) -> tuple[int, int]:
    """The (rollout_batch_size, n_samples_per_prompt) nearest the given one that splits over the trainer's dp
    ranks and stays within the per-adapter cap."""
    rbs, n = max(rbs if isinstance(rbs, int) else 1, 1), max(n if isinstance(n, int) else 1, 1)
    dp = limits.dp_size
    if dp > 0 and min_groups_per_dp_split(n, dp) is None:  # n and dp must divide one another: nearest such n
        n = min((k for k in range(1, max(n, dp) * 2 + 1) if k % dp == 0 or dp % k == 0), key=lambda k: (abs(k - n), k))
    chunk = (min_groups_per_dp_split(n, dp) or 1) if dp > 0 else 1
    most = max(limits.max_adapter_global_batch_size // n // chunk * chunk, chunk)
    return min(-(-rbs // chunk) * chunk, most), n
