"""Adapter naming: the one place that says what an adapter is called on the engines and in request ids.

docs/system.md §3.1 and §4.5: a single adapter is served as `miles_lora`; multi-LoRA adapters live in engine slots named
`__miles_slot_{k}`; a multi-LoRA request id is `name::uuid`, so an abort by the prefix `name::` can never reach
another adapter (valid names cannot contain `::`).
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LORA_ADAPTER_NAME = "miles_lora"
SLOT_PREFIX = "__miles_slot_"
RID_SEPARATOR = "::"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def slot_lora_name(slot: int) -> str:
    return f"{SLOT_PREFIX}{slot}"


def make_rid(adapter: str) -> str:
    return f"{adapter}{RID_SEPARATOR}{uuid.uuid4().hex}"


def rid_prefix(adapter: str) -> str:
    return f"{adapter}{RID_SEPARATOR}"


def parse_adapter(rid: str) -> str | None:
    adapter, sep, _ = rid.rpartition(RID_SEPARATOR)
    return adapter if sep else None


def extra_key(adapter: str, version: int) -> str:
    """Radix-cache namespace: a new adapter version never reuses KV computed under the old one."""
    return f"{adapter}:v{version}"


def adapter_request_fields(adapter: str, lora_name: str, version: int) -> dict[str, str]:
    """The fields every multi-LoRA request carries (docs/system.md §4.5): the engine slot it decodes with, a rid that a
    prefix abort of this adapter reaches, and the radix-cache namespace of this adapter version."""
    # SGLang's /generate calls the adapter's name `lora_path`.
    return {"lora_path": lora_name, "rid": make_rid(adapter), "extra_key": extra_key(adapter, version)}


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (it becomes a folder name and a rid prefix), or None if it can."""
    if not name:
        return "an adapter needs a name"
    if name in (".", ".."):
        return f"'{name}' would name a parent or current folder"
    if not _SAFE_NAME.match(name):
        return f"'{name}' may use only letters, digits, '.', '_' and '-' (no path separators, no '::')"
    if name.startswith(SLOT_PREFIX) or name == LORA_ADAPTER_NAME:
        return f"'{name}' is reserved for engine-side adapter names"
    return None


def min_groups_per_dp_split(n: int, dp: int) -> int | None:
    """docs/system.md §4.6: max(n,dp)//n when the larger divides by the smaller, else None (undefined)."""
    if n <= 0 or dp <= 0:
        return None
    big, small = max(n, dp), min(n, dp)
    return big // n if big % small == 0 else None


@dataclass(frozen=True)
class AdapterLimits:
    """What the engines and the trainer can serve: every adapter must fit all of it."""

    max_slots: int
    max_lora_rank: int
    target_modules: tuple[str, ...]  # the modules the engines were started with LoRA on
    max_adapter_global_batch_size: int
    dp_size: int  # 0: unknown (the plan reports a world size that does not split), no dp check
    tasks: tuple[str, ...]
    rewards: tuple[str, ...]
    agents: tuple[str, ...] = ()


@dataclass(frozen=True)
class AdapterProblem:
    """One reason an adapter cannot run; `fields` are the adapter's settings at fault."""

    fields: tuple[str, ...]
    reason: str

    def __str__(self) -> str:
        return self.reason


def adapter_problems(name: str, values: Mapping[str, Any], limits: AdapterLimits) -> list[AdapterProblem]:
    """Every reason the adapter `name` with resolved `values` (rank, alpha, lr, target_modules, task, reward,
    agent, rollout_batch_size, n_samples_per_prompt, num_step, num_epoch) cannot run within `limits`.

    The one check of an adapter: the plan rules call it for the configured adapters, the multi-LoRA
    controller for every adapter registered at run time, so both refuse the same things."""
    problems = [AdapterProblem(("name",), p) for p in [adapter_name_problem(name)] if p]
    problems += _number_problems(values)
    problems += _serving_problems(values, limits)
    problems += _plugin_problems(values, limits)
    if not problems:  # the batch shape needs well-typed numbers
        problems += _batch_shape_problems(values, limits)
    return problems


def _number_problems(values: Mapping[str, Any]) -> list[AdapterProblem]:
    problems = []
    for key in ("rank", "rollout_batch_size", "n_samples_per_prompt"):
        if not _is_positive_int(values[key]):
            problems.append(AdapterProblem((key,), f"{key} must be a positive integer, got {values[key]!r}"))
    for key in ("num_step", "num_epoch"):
        if values.get(key) is not None and not _is_positive_int(values[key]):
            problems.append(AdapterProblem((key,), f"{key} must be a positive integer when set, got {values[key]!r}"))
    for key in ("alpha", "lr"):
        if not _is_number(values[key]) or not 0 < values[key] < math.inf:  # NaN and infinity are no learning rate
            problems.append(AdapterProblem((key,), f"{key} must be a finite number > 0, got {values[key]!r}"))
    return problems


def _serving_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[AdapterProblem]:
    problems = []
    rank = values["rank"]
    if _is_positive_int(rank) and rank > limits.max_lora_rank:
        problems.append(
            AdapterProblem(("rank",), f"rank {rank} exceeds the engines' max LoRA rank {limits.max_lora_rank}")
        )
    modules = values["target_modules"]
    if isinstance(modules, str) or not isinstance(modules, Sequence) or not modules:
        reason = f"target_modules must be a non-empty list of module names, got {modules!r}"
        return [*problems, AdapterProblem(("target_modules",), reason)]
    if unserved := sorted(set(modules) - set(limits.target_modules)):
        reason = f"target_modules {unserved} are not served by the engines (LoRA on {list(limits.target_modules)})"
        problems.append(AdapterProblem(("target_modules",), reason))
    return problems


def _plugin_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[AdapterProblem]:
    problems = []
    for kind, registered in (("task", limits.tasks), ("reward", limits.rewards), ("agent", limits.agents)):
        value = values.get(kind)
        if (value is not None or kind != "agent") and value not in registered:
            problems.append(AdapterProblem((kind,), f"unknown {kind} {value!r} (registered: {list(registered)})"))
    return problems


def _batch_shape_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[AdapterProblem]:
    rbs, n = values["rollout_batch_size"], values["n_samples_per_prompt"]
    fields = ("rollout_batch_size", "n_samples_per_prompt")
    problems = []
    if rbs * n > limits.max_adapter_global_batch_size:
        problems.append(
            AdapterProblem(
                fields,
                f"rollout_batch_size*n_samples_per_prompt = {rbs * n} exceeds the "
                f"cap {limits.max_adapter_global_batch_size} samples per adapter step",
            )
        )
    if limits.dp_size <= 0:
        return problems
    chunk = min_groups_per_dp_split(n, limits.dp_size)
    if chunk is None:
        reason = f"n_samples_per_prompt {n} and the trainer's dp size {limits.dp_size} must divide one another"
        problems.append(AdapterProblem(fields, reason))
    elif rbs % chunk:
        problems.append(
            AdapterProblem(fields, f"rollout_batch_size {rbs} must be a multiple of {chunk} groups (one dp split)")
        )
    return problems


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter as the plan, the trainer and the loops see it: its names, LoRA shape, task and batch."""

    name: str
    lora_name: str  # the engine-side adapter name: miles_lora, or the slot name
    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    task: str
    reward: str
    lr: float
    rollout_batch_size: int
    n_samples_per_prompt: int
    num_step: int | None = None
    num_epoch: int | None = None
    data: str = ""
    agent: str | None = None  # plays its episodes when a session server runs; None: rollout.agent
    init_path: str = ""  # a PEFT folder the adapter starts from (adapters.path); "": a fresh adapter


def adapter_spec(name: str, lora_name: str, values: Mapping[str, Any], *, dropout: float = 0.0) -> AdapterSpec:
    """The spec of an adapter from its resolved settings (a configured adapter's, or a registered one's
    config): the one place an AdapterSpec is put together."""
    return AdapterSpec(
        name=name,
        lora_name=lora_name,
        rank=values["rank"],
        alpha=values["alpha"],
        dropout=dropout,
        target_modules=list(values["target_modules"]),
        task=values["task"],
        reward=values["reward"],
        lr=values["lr"],
        rollout_batch_size=values["rollout_batch_size"],
        n_samples_per_prompt=values["n_samples_per_prompt"],
        num_step=values.get("num_step"),
        num_epoch=values.get("num_epoch"),
        data=values.get("data") or "",
        agent=values.get("agent"),
        init_path=values.get("init_path") or "",
    )
