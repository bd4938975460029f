"""Compiling override lists through the public path (Hydra compose -> compile_plan), memoised for the test run.

Each compose costs a noticeable fraction of a second and the rule tables reuse the same configs (a bad config, then
bad + its fix; the field coverage table refuses the same values), so outcomes are memoised. Hydra applies overrides in
order and the last one for a key wins, so an earlier override of the same key is dropped first: `base + bad + fix` then
shares its entry with `base + good`.

Under pytest-xdist the composed configs are also shared between the workers of one run, as pickles in the folder
that tests/conftest.py makes for the run (MEMO_ENV): the tests of one rule land on different workers, and each
composed the same configs again (a quarter of `make test-fast`'s composes). A compose depends only on its overrides
within a run (the same checkout, environment and working folder for every worker).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from miles_runner.config.compose import ComposedConfig, compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import Plan

MEMO_ENV = "MILES_TEST_COMPOSE_MEMO"  # the run's shared folder; unset: this process memoises alone


@cache
def composed_or_error(overrides: tuple[str, ...]) -> ComposedConfig | PlanError:
    shared = _shared_path(overrides)
    if shared is not None:
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
            return pickle.loads(shared.read_bytes())
    try:
        result: ComposedConfig | PlanError = compose(list(overrides))
    except PlanError as exc:
        result = exc
    if shared is not None:
        _write_atomically(shared, pickle.dumps(result))
    return result


@cache
def _outcome(overrides: tuple[str, ...], design: bool = False) -> Plan | PlanError:
    # One compose serves both compilations (the rule tables ask for `base + good` as a design and, through a
    # pasted fix, often as a plan); compiling leaves the composed config as it was (plan_or_design does the same).
    composed = composed_or_error(overrides)
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


def _shared_path(overrides: tuple[str, ...]) -> Path | None:
    folder = os.environ.get(MEMO_ENV)
    if not folder:
        return None
    digest = hashlib.sha256("\0".join(overrides).encode()).hexdigest()
    return Path(folder) / f"{digest}.pickle"


def _write_atomically(path: Path, data: bytes) -> None:
    """Another worker reads a whole pickle or none (a failed write only costs that worker a compose of its own)."""
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        staging.write_bytes(data)
        os.replace(staging, path)
