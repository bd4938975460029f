"""Plain data -> frozen dataclasses, with every schema problem reported at once.

One loader for every typed tree in the project (the config, and the Plan read back from plan.yaml). It rejects
unknown keys (with a did-you-mean), wrong types and values outside a field's choices, naming the full key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
# A field path -> the values it may take.
Choices = Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class SchemaIssue:
    path: str
    message: str
    hint: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" + (f" ({self.hint})" if self.hint else "")


class SchemaError(ValueError):
    def __init__(self, issues: list[SchemaIssue]):
        self.issues = issues
        super().__init__("\n".join(str(i) for i in issues))


def load_dataclass(
    cls: type[T],
    data: Any,
    choices: Mapping[str, tuple[str, ...]] | None = None,
    renamed: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from nested dicts/lists; raise SchemaError listing every problem found. A key of `renamed`
    (old dotted path -> new) is reported at its old path with the new one as the hint."""
    issues: list[SchemaIssue] = []
    value: T = _convert(cls, data, "", issues, choices or {})
    if issues:
        raise SchemaError([_renamed_issue(i, data, renamed) if renamed else i for i in issues])
    return value


def renamed_hint(new: str) -> str:
    return f"renamed: did you mean '{new}'?"


def _renamed_issue(issue: SchemaIssue, data: Any, renamed: Mapping[str, str]) -> SchemaIssue:
    """An unknown key that is an old spelling (or a section holding one, as `lora: {mode: ...}`) names the new key."""
    if issue.message != "unknown key":
        return issue
    for old, new in renamed.items():
        if old == issue.path or (old.startswith(issue.path + ".") and _holds(data, old)):
            return SchemaIssue(old, issue.message, renamed_hint(new))
    return issue


def _holds(data: Any, path: str) -> bool:
    for part in path.split("."):
        if not isinstance(data, Mapping) or part not in data:
            return False
        data = data[part]
    return True


def did_you_mean(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(tp: Any, value: Any, path: str, issues: list[SchemaIssue], choices: Choices) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _convert_union(args, value, path, issues, choices)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            issues.append(SchemaIssue(path, f"expected {_type_name(tp)}, got {_describe(value)}"))
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, path, issues, choices)
    if origin is list:
        return _convert_list(typing.get_args(tp)[0], value, path, issues, choices)
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            issues.append(SchemaIssue(path, f"expected a mapping, got {_describe(value)}"))
            return {}
        return dict(value)
    if tp is Any:
        return value
    return _convert_scalar(tp, value, path, issues, choices)


def _convert_union(args: list[Any], value: Any, path: str, issues: list[SchemaIssue], choices: Choices) -> Any:
    """The value as the first member type that takes it whole (`int | Literal["auto"]`: a port or "auto")."""
    if len(args) == 1:
        return _convert(args[0], value, path, issues, choices)
    for arg in args:
        tried: list[SchemaIssue] = []
        converted = _convert(arg, value, path, tried, choices)
        if not tried:
            return converted
    issues.append(SchemaIssue(path, f"expected {' or '.join(map(_type_name, args))}, got {_describe(value)}"))
    return value


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(arg) for arg in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert_dataclass(cls: type, value: Any, path: str, issues: list[SchemaIssue], choices: Choices) -> Any:
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        issues.append(SchemaIssue(path or "<root>", f"expected a section, got {_describe(value)}"))
        return cls()
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in value:
        if key not in hints:
            issues.append(SchemaIssue(_join(path, str(key)), "unknown key", did_you_mean(str(key), names)))
    kwargs = {k: _convert(hints[k], value[k], _join(path, k), issues, choices) for k in names if k in value}
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a field without a default that was not given
        issues.append(SchemaIssue(path or "<root>", str(exc)))
        return None


def _convert_list(item_tp: Any, value: Any, path: str, issues: list[SchemaIssue], choices: Choices) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str) and item_tp is str:  # "a,b" on a command line means a list of two
        return [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list | tuple):
        issues.append(SchemaIssue(path, f"expected a list, got {_describe(value)}"))
        return []
    return [_convert(item_tp, v, f"{path}[{i}]", issues, choices) for i, v in enumerate(value)]


def _convert_scalar(tp: type, value: Any, path: str, issues: list[SchemaIssue], choices: Choices) -> Any:
    ok = (
        (tp is bool and isinstance(value, bool))
        or (tp is int and isinstance(value, int) and not isinstance(value, bool))
        or (tp is float and isinstance(value, int | float) and not isinstance(value, bool))
        or (tp is str and isinstance(value, str | int | float) and not isinstance(value, bool))
    )
    if not ok:
        issues.append(SchemaIssue(path, f"expected {tp.__name__}, got {_describe(value)}"))
        return value
    value = tp(value)
    allowed = choices.get(path)
    if allowed and value not in allowed:
        hint = did_you_mean(value, allowed) or "one of: " + ", ".join(allowed)
        issues.append(SchemaIssue(path, f"'{value}' is not a valid choice", hint))
    return value


def _describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"
