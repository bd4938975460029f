"""The kinds of evidence that a schema field is honoured: acted on by the runtime, or refused by a rule."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runs:
    """The runtime acts on the field: each named test drives the code path that reads it and fails if the field
    were ignored. `tests` are pytest node ids (`tests/pkg/test_x.py::test_name`)."""

    tests: tuple[str, ...]


@dataclass(frozen=True)
class Refused:
    """Set to `value` on top of `base` overrides, the field is refused by `rule`, which names it: the runtime for
    that plan cannot honour the value."""

    rule: str
    value: str
    base: tuple[str, ...] = ()


Evidence = Runs | Refused
