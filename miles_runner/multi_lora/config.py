"""One adapter run's configuration (docs/system.md §4.1) and the checks it passes at registration (§4.3).

An adapter comes from the plan (`AdapterSpec`) or from a POST to the controller's API; both go through
`resolve_adapter_config`, so the same values are defaulted and the same rules apply either way. Every problem
is reported at once, in one ValueError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles_runner.core.adapters import AdapterLimits, AdapterSpec, adapter_name_problem, adapter_problems
from miles_runner.plan.derive import BUNDLED_DATA, resolve_data_path


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
    save_root: str  # an adapter's save folder defaults to <save_root>/adapters/<name>, and must be inside it
    # Folders an adapter's data file may be read from, besides the bundled prompt sets and the save root.
    data_roots: tuple[str, ...] = ()

    @property
    def adapters_root(self) -> Path:
        return Path(self.save_root).resolve() / "adapters"

    def readable_roots(self) -> tuple[Path, ...]:
        roots = [BUNDLED_DATA, *(Path(root) for root in self.data_roots)]
        return tuple(root.resolve() for root in roots) + ((Path(self.save_root).resolve(),) if self.save_root else ())


def plan_overrides(adapter: AdapterSpec) -> dict[str, Any]:
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
    if name_problem := adapter_name_problem(name):
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
        "save": str(defaults.adapters_root / name) if defaults.save_root else "",
        "metadata": {},
        "agent": None,
        **given,
    }
    values["data"] = resolve_data_path(values.get("data") or "")  # bundled:NAME, or relative to the controller
    problems = config_problems(name, values, limits) + place_problems(values, defaults)
    if problems:
        raise ValueError(f"adapter '{name}' cannot run: " + "; ".join(problems))
    return AdapterRunConfig.from_dict({**values, "target_modules": tuple(values["target_modules"])})


def config_problems(name: str, values: Mapping[str, Any], limits: AdapterLimits) -> list[str]:
    """The one adapter check (core.adapters), plus what only a running controller can check: a save folder
    and metadata (where save and data may be: place_problems)."""
    problems = [str(p) for p in adapter_problems(name, values, limits)]
    if not values["save"]:
        problems.append("no save folder: set 'save', or give the controller a save root")
    if not isinstance(values["metadata"], Mapping):
        problems.append("metadata must be a mapping")
    return problems


def place_problems(values: dict[str, Any], defaults: AdapterDefaults) -> list[str]:
    """An API caller must not make the controller write or read outside the run's folders: `save` goes inside
    <save_root>/adapters (a relative one is taken from there), `data` is a file inside a readable root. The
    answer is the same whether a refused path exists or not (it must not tell a caller what is on the host)."""
    problems = []
    if defaults.save_root and (save := values["save"]):
        root = defaults.adapters_root
        if (resolved := resolved_inside(root, save)) is None or resolved == root:
            problems.append(f"save must name a folder inside {root}, got {save!r}")
        else:
            values["save"] = str(resolved)  # a relative one is taken from the adapters folder
    if data := values.get("data"):
        roots = defaults.readable_roots()
        if not any(is_file_inside(root, data) for root in roots):
            problems.append(
                f"data {data!r} is not a readable file under the controller's data folders "
                f"({', '.join(map(str, roots))})"
            )
    return problems


def resolved_inside(root: Path, path: str) -> Path | None:
    """`path` taken from `root` with links and '..' resolved, if it stays inside `root`; else None (also for a
    path the OS refuses: a NUL byte, a name too long)."""
    try:
        resolved = (root / path).resolve()
    except (OSError, ValueError):
        return None
    return resolved if resolved.is_relative_to(root) else None


def is_file_inside(root: Path, path: str) -> bool:
    resolved = resolved_inside(root, path)
    try:
        return resolved is not None and resolved.is_file()
    except (OSError, ValueError):
        return False
