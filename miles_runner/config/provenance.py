"""Where each configured value came from: default, group option, recipe or command line.

Hydra does not keep this, so it is rebuilt from the same inputs Hydra composed: the chosen group options'
files, the recipe file and the command-line overrides, applied in Hydra's order (later wins).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from miles_runner.config.sources import ConfigSource, find_option

DEFAULT = "default"
GROUP = "group option"
RECIPE = "recipe"
COMMAND_LINE = "command line"


@dataclass(frozen=True)
class Origin:
    kind: str
    detail: str = ""  # the group choice ("topology=colocated") or recipe name

    def __str__(self) -> str:
        if self.kind == RECIPE:
            return f"recipe {self.detail}"
        return (self.detail and f"{self.kind} {self.detail}") or self.kind


@dataclass(frozen=True)
class Provenance:
    """Origins of group choices (by group name) and of values (by dotted key path)."""

    choices: dict[str, str]
    choice_origins: dict[str, Origin]
    value_origins: dict[str, Origin]
    value_groups: dict[str, str]  # key path -> the group whose option file set it

    def origin(self, path: str) -> Origin:
        """The origin of a key, or of its closest configured parent (lists are set whole)."""
        below = [k for k in self.value_origins if k.startswith(path + ".")]
        if below:  # a new (unknown) subtree: it came from wherever its keys did
            return self.value_origins[below[0]]
        probe = path
        while probe:
            if probe in self.value_origins:
                return self.value_origins[probe]
            probe = probe.rpartition(".")[0] if "." in probe else ""
        return Origin(DEFAULT)

    def display(self, path: str, value: Any) -> tuple[str, Origin]:
        """How to show a key to a user: as the group choice that set it, when one did."""
        group = self.value_groups.get(path)
        if group and self.origin(path).kind == GROUP:
            return f"{group}={self.choices[group]}", self.choice_origins[group]
        return f"{path}={format_value(value)}", self.origin(path)


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def read_option_file(path: Path) -> tuple[str | None, dict[str, Any]]:
    """(the `# @package` header if any, the body) of a Hydra config file, a copy the caller may change. Each file
    is parsed once per version (its mtime and size): every composition reads a dozen of them, and a sweep or the
    config fuzz composes hundreds of times."""
    stat = path.stat()
    package, body = _parsed_option_file(path, stat.st_mtime_ns, stat.st_size)
    return package, copy.deepcopy(body)


@lru_cache(maxsize=1024)
def _parsed_option_file(path: Path, mtime_ns: int, size: int) -> tuple[str | None, dict[str, Any]]:
    text = path.read_text()
    package = None
    for line in text.splitlines():
        if line.startswith("# @package"):
            package = line.split(None, 2)[2].strip()
            break
    return package, yaml.safe_load(text) or {}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf paths of a nested dict; lists are leaves (they are replaced whole on merge)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, path))
        else:
            out[path] = value
    return out


def split_override(text: str) -> tuple[str, str]:
    key, _, value = text.partition("=")
    return key.lstrip("+~"), value


def option_body(sources: Sequence[ConfigSource], group: str, option: str) -> tuple[str | None, dict[str, Any]]:
    """The option file Hydra composed for `group=option`, from whichever config folder it came."""
    path = find_option(sources, group, option)
    return read_option_file(path) if path is not None else (None, {})


def build_provenance(
    sources: Sequence[ConfigSource], choices: dict[str, str], overrides: list[str], groups: set[str]
) -> Provenance:
    cli = dict(split_override(o) for o in overrides)
    recipe = choices.get("recipe")
    recipe_defaults: dict[str, str] = {}
    recipe_values: dict[str, Any] = {}
    if recipe:
        _, body = option_body(sources, "recipe", recipe)
        for item in body.pop("defaults", []) or []:
            if isinstance(item, dict):
                for key, option in item.items():
                    recipe_defaults[key.removeprefix("override ").strip().lstrip("/")] = str(option)
        recipe_values = flatten(body)

    choice_origins: dict[str, Origin] = {}
    value_origins: dict[str, Origin] = {}
    value_groups: dict[str, str] = {}
    for group in sorted(groups):
        if group not in choices or choices[group] is None:
            continue
        if group in cli:
            choice_origins[group] = Origin(COMMAND_LINE)
        elif group in recipe_defaults:
            choice_origins[group] = Origin(RECIPE, recipe or "")
        else:
            choice_origins[group] = Origin(DEFAULT)
        if group == "recipe":
            continue
        package, body = option_body(sources, group, choices[group])
        for path in flatten(body, package or group):
            value_origins[path] = Origin(GROUP, f"{group}={choices[group]}")
            value_groups[path] = group
    for path in recipe_values:
        value_origins[path] = Origin(RECIPE, recipe or "")
    for key in cli:
        if key not in groups:
            value_origins[key] = Origin(COMMAND_LINE)
    return Provenance(dict(choices), choice_origins, value_origins, value_groups)
