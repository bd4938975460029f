"""What every rule module shares: the Finding a rule yields, the `rule` decorator and the registries it fills,
and the config keys that several sections name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, overload

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived


@dataclass(frozen=True)
class Finding:
    keys: tuple[str, ...]
    reason: str
    fix: str = ""


RuleFn = Callable[[MilesConfig, Derived], Iterator[Finding]]
# A precondition runs before anything is derived: it is given None.
PreconditionFn = Callable[[MilesConfig, Derived | None], Iterator[Finding]]
RULES: dict[str, RuleFn] = {}
# Rules whose failure makes the others meaningless (they divide by these sizes): checked first, alone.
PRECONDITIONS: dict[str, PreconditionFn] = {}


@overload
def rule(rule_id: str, *, precondition: Literal[False] = False) -> Callable[[RuleFn], RuleFn]: ...
@overload
def rule(rule_id: str, *, precondition: Literal[True]) -> Callable[[PreconditionFn], PreconditionFn]: ...
def rule(rule_id: str, *, precondition: bool = False) -> Callable[[Any], Any]:
    def register(fn: Any) -> Any:
        registry: dict[str, Any] = PRECONDITIONS if precondition else RULES
        registry[rule_id] = fn
        return fn

    return register


# Keys that rules in several sections name; spelled once so that they name them alike.
PAUSE = "weight_sync.pause_generation_mode"
TOPOLOGY = "topology.kind"
ADAPTERS = "adapters.kind"
LORA_MODE = "trainer.lora_mode"
BACKEND = "trainer.backend"
