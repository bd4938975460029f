"""One adapter run's configuration (spec §4.1) and the checks it passes at registration (§4.3).

An adapter comes from the plan (`AdapterPlan`) or from a POST to the controller's API; both go through
`resolve_adapter_config`, so the same values are defaulted and the same rules apply either way. Every problem
is reported at once, in one ValueError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_runner.core.adapters import adapter_name_problem
from miles_runner.plan.derive import min_groups_per_dp_split, resolve_data_path
from miles_runner.plan.model import AdapterPlan


@dataclass(frozen=True)
class AdapterRunConfig:
    task: str
    reward: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    lr: float
    rollout_batch_size: int  # prompt groups per optimizer step of this adapter
    n_samples_per_prompt: int
    save: str  # the adapter's own folder: checkpoints/step_N live under it
    num_step: int | None = None  # steps after (re)start before the adapter retires itself; None: from num_epoch
    num_epoch: int | None = None
    data: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)  # merged into every sample's metadata
    # The agent plug-in that plays its episodes when the run has a session server; None: the run's rollout.agent.
    agent: str | None = None

    @property
    def adapter_global_batch_size(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterRunConfig:
        return cls(**{**data, "target_modules": tuple(data["target_modules"]), "metadata": dict(data["metadata"])})


CONFIG_KEYS = frozenset(f.name for f in dataclasses.fields(AdapterRunConfig))


@dataclass(frozen=True)
class AdapterDefaults:
    """What an adapter that does not say otherwise gets (the run's global LoRA and rollout settings)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    lr: float
    rollout_batch_size: int
    n_samples_per_prompt: int
    task: str
    reward: str
    save_root: str  # an adapter's save folder defaults to <save_root>/adapters/<name>


@dataclass(frozen=True)
class AdapterLimits:
    """What the engines and the trainer can serve: every registered adapter must fit all of it."""

    max_slots: int
    max_lora_rank: int
    target_modules: tuple[str, ...]  # the modules the engines were started with LoRA on
    max_adapter_global_batch_size: int
    dp_size: int
    tasks: tuple[str, ...]
    rewards: tuple[str, ...]
    agents: tuple[str, ...] = ()


def plan_overrides(adapter: AdapterPlan) -> dict[str, Any]:
    """The config an adapter of the plan registers with (the plan already resolved its defaults)."""
    return {
        "task": adapter.task,
        "reward": adapter.reward,
        "rank": adapter.rank,
        "alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules),
        "lr": adapter.lr,
        "rollout_batch_size": adapter.rollout_batch_size,
        "n_samples_per_prompt": adapter.n_samples_per_prompt,
        "num_step": adapter.num_step,
        "num_epoch": adapter.num_epoch,
        "data": adapter.data,
        "agent": adapter.agent,
    }


def resolve_adapter_config(
    name: str, overrides: Mapping[str, Any], defaults: AdapterDefaults, limits: AdapterLimits
) -> AdapterRunConfig:
    """The adapter's full config: `overrides` over `defaults`, checked against `limits` (ValueError lists all)."""
    name_problem = adapter_name_problem(name)
    if name_problem:
        raise ValueError(name_problem)
    unknown = sorted(set(overrides) - CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown adapter config keys {unknown}; known: {sorted(CONFIG_KEYS)}")
    given = {key: value for key, value in overrides.items() if value is not None}
    values: dict[str, Any] = {
        "task": defaults.task,
        "reward": defaults.reward,
        "rank": defaults.rank,
        "alpha": defaults.alpha,
        "target_modules": defaults.target_modules,
        "lr": defaults.lr,
        "rollout_batch_size": defaults.rollout_batch_size,
        "n_samples_per_prompt": defaults.n_samples_per_prompt,
        "save": str(Path(defaults.save_root) / "adapters" / name) if defaults.save_root else "",
        "metadata": {},
        "agent": None,
        **given,
    }
    values["data"] = resolve_data_path(values.get("data") or "")  # bundled:NAME, or relative to the controller
    problems = list(config_problems(values, limits))
    if problems:
        raise ValueError(f"adapter '{name}' cannot run: " + "; ".join(problems))
    return AdapterRunConfig.from_dict({**values, "target_modules": tuple(values["target_modules"])})


def config_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    problems = [
        *_number_problems(values),
        *_serving_problems(values, limits),
        *_plugin_problems(values, limits),
    ]
    if not problems:  # the batch shape needs well-typed numbers
        problems += _batch_shape_problems(values, limits)
    if not values["save"]:
        problems.append("no save folder: set 'save', or give the controller a save root")
    if values.get("data") and not Path(values["data"]).exists():
        problems.append(f"data '{values['data']}' does not exist on the controller's host")
    if not isinstance(values["metadata"], Mapping):
        problems.append("metadata must be a mapping")
    return problems


def _number_problems(values: Mapping[str, Any]) -> list[str]:
    problems = []
    for key in ("rank", "rollout_batch_size", "n_samples_per_prompt"):
        if not _is_positive_int(values[key]):
            problems.append(f"{key} must be a positive integer, got {values[key]!r}")
    for key in ("num_step", "num_epoch"):
        if values.get(key) is not None and not _is_positive_int(values[key]):
            problems.append(f"{key} must be a positive integer when set, got {values[key]!r}")
    for key in ("alpha", "lr"):
        if not _is_number(values[key]) or values[key] <= 0:
            problems.append(f"{key} must be a number > 0, got {values[key]!r}")
    return problems


def _serving_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    problems = []
    rank = values["rank"]
    if _is_positive_int(rank) and rank > limits.max_lora_rank:
        problems.append(f"rank {rank} exceeds the engines' max LoRA rank {limits.max_lora_rank}")
    modules = values["target_modules"]
    if isinstance(modules, str) or not isinstance(modules, Sequence) or not modules:
        return [*problems, f"target_modules must be a non-empty list of module names, got {modules!r}"]
    unserved = sorted(set(modules) - set(limits.target_modules))
    if unserved:
        problems.append(
            f"target_modules {unserved} are not served by the engines (LoRA on {list(limits.target_modules)})"
        )
    return problems


def _plugin_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    problems = []
    if values["task"] not in limits.tasks:
        problems.append(f"unknown task {values['task']!r} (registered: {list(limits.tasks)})")
    if values["reward"] not in limits.rewards:
        problems.append(f"unknown reward {values['reward']!r} (registered: {list(limits.rewards)})")
    if values["agent"] is not None and values["agent"] not in limits.agents:
        problems.append(f"unknown agent {values['agent']!r} (registered: {list(limits.agents)})")
    return problems


def _batch_shape_problems(values: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    rbs, n = values["rollout_batch_size"], values["n_samples_per_prompt"]
    problems = []
    if rbs * n > limits.max_adapter_global_batch_size:
        problems.append(
            f"rollout_batch_size*n_samples_per_prompt = {rbs * n} exceeds the cap "
            f"{limits.max_adapter_global_batch_size} samples per adapter step"
        )
    chunk = min_groups_per_dp_split(n, limits.dp_size)
    if chunk is None:
        problems.append(f"n_samples_per_prompt {n} and the trainer's dp size {limits.dp_size} must divide one another")
    elif rbs % chunk:
        problems.append(f"rollout_batch_size {rbs} must be a multiple of {chunk} groups (one dp split)")
    return problems


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
