"""Compiling override lists through the public path (Hydra compose -> compile_plan), cached per test session.

`outcome` and `problems` are what `miles-run` gets (compile_plan: every rule). `plan` is the design
(compile_design: the NOT_BUILT refusals left out), so the spec's rules can be checked on GPU recipes whose
trainer this release has not built yet.

Each compose costs ~0.1 s and the rule tables reuse the same configs (a bad config, then bad + its fix), so
outcomes are memoised. Hydra applies overrides in order and the last one for a key wins, so an earlier
override of the same key is dropped first: `base + bad + fix` then shares its entry with `base + good`.
"""

from collections.abc import Callable, Sequence
from functools import cache

import pytest

from miles_runner.config.compose import ComposedConfig, compose
from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import Plan


@cache
def _composed(overrides: tuple[str, ...]) -> ComposedConfig | PlanError:
    try:
        return compose(list(overrides))
    except PlanError as exc:
        return exc


@cache
def _outcome(overrides: tuple[str, ...], design: bool = False) -> Plan | PlanError:
    # One compose serves both compilations (the rule tables ask for `base + good` as a design and, through a
    # pasted fix, often as a plan); compiling leaves the composed config as it was (plan_or_design does the same).
    composed = _composed(overrides)
    if isinstance(composed, PlanError):
        return composed
    try:
        return (compile_design if design else compile_plan)(composed)
    except PlanError as exc:
        return exc


def last_per_key(overrides: Sequence[str]) -> tuple[str, ...]:
    """The overrides with every one that a later override of the same key replaces left out, order kept."""
    keys = [o.partition("=")[0].lstrip("+~") for o in overrides]
    return tuple(o for i, o in enumerate(overrides) if keys[i] not in keys[i + 1 :])


def compile_overrides(overrides: Sequence[str], *, design: bool = False) -> Plan | PlanError:
    """The Plan, or the PlanError, for these overrides (any other exception propagates: it is a bug)."""
    return _outcome(last_per_key(overrides), design)


@pytest.fixture(scope="session")
def composed() -> Callable[[tuple[str, ...]], ComposedConfig | PlanError]:
    """The composed config of these overrides, or the PlanError composing them raised (memoised)."""
    return _composed


@pytest.fixture(scope="session")
def outcome() -> Callable[[Sequence[str]], Plan | PlanError]:
    return compile_overrides


@pytest.fixture(scope="session")
def problems() -> Callable[[Sequence[str]], list[Problem]]:
    """Every problem these overrides raise; [] when they compile to a Plan."""

    def of(overrides: Sequence[str]) -> list[Problem]:
        result = compile_overrides(overrides)
        return result.problems if isinstance(result, PlanError) else []

    return of


@pytest.fixture(scope="session")
def plan() -> Callable[[Sequence[str]], Plan]:
    """The design Plan for these overrides; fails the test, showing the problems, when they do not compile."""

    def of(overrides: Sequence[str]) -> Plan:
        result = compile_overrides(overrides, design=True)
        if isinstance(result, PlanError):
            pytest.fail(f"{list(overrides)} did not compile:\n{result}")
        return result

    return of
