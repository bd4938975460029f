"""Compiling override lists through the public path (Hydra compose -> compile_plan), cached per test session
(tests/compiled.py).

`outcome` and `problems` are what `miles-run` gets (compile_plan: every rule). `plan` is the design (compile_design: the
NOT_BUILT refusals left out), so the rules of docs/system.md §1.2 can be checked on GPU recipes whose trainer this
release has not built yet.
"""

from collections.abc import Callable, Sequence

import pytest

from miles_runner.config.compose import ComposedConfig
from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.model import Plan
from tests.compiled import compile_overrides, composed_or_error


@pytest.fixture(scope="session")
def composed() -> Callable[[tuple[str, ...]], ComposedConfig | PlanError]:
    """The composed config of these overrides, or the PlanError composing them raised (memoised)."""
    return composed_or_error


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
