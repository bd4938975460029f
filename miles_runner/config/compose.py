"""Hydra composition -> a typed, validated MilesConfig plus where each value came from.

Composition uses Hydra's compose API, so group options, `+recipe=NAME` and overrides behave exactly as under
`@hydra.main` (which the multirun path uses). Hydra's own errors are translated into PlanError problems that
name the key and suggest the nearest valid one.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import MISSING, Container, DictConfig, OmegaConf

from miles_runner.config.hydra_instantiation import instantiation_problems
from miles_runner.config.hydra_settings import composed_setting_problems, user_run_dir
from miles_runner.config.loader import SchemaError, did_you_mean, load_dataclass, renamed_hint
from miles_runner.config.provenance import COMMAND_LINE, Provenance, build_provenance, flatten
from miles_runner.config.schema import CHOICES, RENAMED_KEYS, MilesConfig, defaults_tree
from miles_runner.config.sources import (
    ConfigSource,
    config_sources,
    group_names,
    group_options,
    missing_folder_problems,
    searchpath_entries,
)
from miles_runner.core.errors import PlanError, Problem
from miles_runner.core.paths import conf_dir, recipes_dir

CONF_DIR = conf_dir()  # the shipped config folder (miles_runner/_resources/conf)
RECIPES_DIR = recipes_dir()  # the shipped recipes (its `recipe` group)
BASE_NAME = "miles_base"


@dataclass(frozen=True)
class ComposedConfig:
    config: MilesConfig
    provenance: Provenance
    overrides: list[str]
    recipe: str | None
    searchpath: tuple[str, ...] = ()  # hydra.searchpath: the user's config folders
    run_dir: str = ""  # hydra.run.dir when the user set it: the run folder, exactly


def config_groups(sources: Sequence[ConfigSource] = ()) -> set[str]:
    return group_names(sources or config_sources())


@cache
def register_base() -> None:
    """Put the schema defaults into Hydra's ConfigStore as `miles_base` (a plain, untyped node)."""
    ConfigStore.instance().store(name=BASE_NAME, node=defaults_tree())


def compose(overrides: list[str]) -> ComposedConfig:
    register_base()
    searchpath = searchpath_entries(overrides)
    if problems := missing_folder_problems(searchpath):
        raise PlanError(problems)
    try:
        cfg = _hydra_compose(overrides)
    except HydraException as exc:
        raise PlanError([composition_problem(str(exc), config_sources(searchpath))]) from None
    if problems := composed_setting_problems(cfg, overrides) + instantiation_problems(cfg.hydra, shipped_hydra):
        raise PlanError(problems)
    return from_hydra_job(cfg, cfg.hydra, overrides, user_run_dir(cfg))


def resolved_sweep_dir(overrides: list[str]) -> str:
    """The sweep folder these overrides give (hydra.sweep.dir, its `${now:...}` resolved now). The swept settings
    are left out: one config is composed, and a sweep folder does not depend on them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    register_base()
    single = [text for text, override in zip(overrides, parsed, strict=True) if not override.is_sweep_override()]
    return str(_hydra_compose(single).hydra.sweep.dir)


@cache
def shipped_hydra() -> Any:
    """The `hydra` node of the shipped config alone (no user folder, recipe or override)."""
    register_base()
    return _hydra_compose([]).hydra


def _hydra_compose(overrides: list[str]) -> Any:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), _config_store_shared_by_copies():
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


@contextlib.contextmanager
def _config_store_shared_by_copies() -> Iterator[None]:
    """Within the block, a deep copy of Hydra's ConfigStore is the store itself. Every compose deep-copies its config
    repository, whose structured source holds the ConfigStore singleton, so each compose copied every stored node
    (Hydra's own and miles_base): a fifth of a compose's time. The copy is only ever read (ConfigStore.load copies
    the node it returns), so sharing the store changes nothing composed (tests/config/test_compose_hydra.py)."""
    ConfigStore.__deepcopy__ = _same_store  # type: ignore[attr-defined]  # added for the block only
    try:
        yield
    finally:
        del ConfigStore.__deepcopy__  # type: ignore[attr-defined]


def _same_store(store: ConfigStore, memo: dict[int, Any]) -> ConfigStore:
    return store


def job_tree(cfg: Any) -> dict[str, Any]:
    """The composed config as plain data, without Hydra's own node: each other top-level node converted on its own
    (its interpolations still resolve against the whole config). Copying the config to drop `hydra` is many times
    slower, a noticeable part of a compose."""
    return {key: _plain(cfg, key) for key in cfg if key != "hydra"}


def _plain(cfg: DictConfig, key: str) -> Any:
    node = cfg._get_node(key)
    assert node is not None  # `key` is one of cfg's own
    if isinstance(node, Container):
        return OmegaConf.to_container(node, resolve=True)
    return MISSING if node._is_missing() else cfg[key]  # as to_container leaves a missing value


def from_hydra_job(cfg: Any, hc: Any, overrides: Sequence[str], run_dir: str = "") -> ComposedConfig:
    """A composed config (compose()'s, a @hydra.main job's `cfg`, or a launcher's sweep config) and its `hydra`
    node, validated against the schema. Hydra's own group choices (hydra/launcher, ...) are not ours."""
    runtime_choices = cast(dict[str, str], OmegaConf.to_container(hc.runtime.choices))
    choices = {k: v for k, v in runtime_choices.items() if not k.startswith("hydra/")}
    return from_composed(job_tree(cfg), choices, list(overrides), list(hc.searchpath), run_dir)


def from_composed(
    tree: dict[str, Any],
    choices: dict[str, str],
    overrides: list[str],
    searchpath: Sequence[str] = (),
    run_dir: str = "",
) -> ComposedConfig:
    """Validate a composed tree (from compose() or from a @hydra.main job) against the schema."""
    sources = config_sources(searchpath)
    provenance = build_provenance(sources, choices, overrides, config_groups(sources))
    try:
        config = load_dataclass(MilesConfig, tree, CHOICES, RENAMED_KEYS)
    except SchemaError as exc:
        raise PlanError([schema_problem(issue, provenance) for issue in exc.issues]) from None
    return ComposedConfig(config, provenance, list(overrides), choices.get("recipe"), tuple(searchpath), run_dir)


def schema_problem(issue: Any, provenance: Provenance) -> Problem:
    base_path = re.sub(r"\[\d+\].*$", "", issue.path)
    origin = provenance.origin(base_path)
    rule = "unknown-key" if issue.message == "unknown key" else "invalid-value"
    fix = ""
    if issue.path in RENAMED_KEYS:  # an old spelling: the new key, wherever it lives
        fix = f"rename it to {RENAMED_KEYS[issue.path]}"
    elif issue.hint.startswith("did you mean '"):
        suggestion = issue.hint.split("'")[1]
        if rule == "unknown-key":  # a misspelt key: the near key under the same parent
            parent = issue.path.rpartition(".")[0]
            fix = f"rename it to {parent + '.' if parent else ''}{suggestion}"
        else:  # a misspelt choice: the near value, as an override to paste
            fix = f"{issue.path}={suggestion}"
    reason = f"{issue.message}; {issue.hint}" if issue.hint else issue.message
    return Problem(rule, [(issue.path, str(origin))], reason.rstrip(), fix)


_OVERRIDE_RE = re.compile(r"Could not override '([^']+)'")
_RUN_ITEM_RE = re.compile(r"^adapters\.runs\.(\d+)\.(\w+)$")
_MISSING_RE = re.compile(r"Could not find '([^'/]+)/([^']+)'")
_MISSING_RECIPE_HINT = "miles-run --recipes lists them"


def composition_problem(message: str, sources: Sequence[ConfigSource] = ()) -> Problem:
    """Turn Hydra's composition error into a Problem with a did-you-mean."""
    if match := _OVERRIDE_RE.search(message):
        key = match.group(1)
        if item := _RUN_ITEM_RE.match(key):  # a field this list item does not set yet: it must be added
            return Problem(
                "unset-list-item-field",
                [(key, COMMAND_LINE)],
                f"adapter run {item.group(1)} does not set '{item.group(2)}' yet; a new field needs '++'.",
                f"++{key}=...",
            )
        known = list(flatten(defaults_tree())) + sorted(config_groups(sources))
        if key in RENAMED_KEYS:  # Hydra's message quotes the override: "To append to your config use +KEY=VALUE"
            value = re.search(rf"\+{re.escape(key)}=(\S*)", message)
            return Problem(
                "unknown-key",
                [(key, COMMAND_LINE)],
                f"no such key; {renamed_hint(RENAMED_KEYS[key])}",
                f"{RENAMED_KEYS[key]}={value.group(1) if value else '...'}",
            )
        hint = did_you_mean(key, known)
        return Problem(
            "unknown-key",
            [(key, COMMAND_LINE)],
            f"no such key or config group. {hint}".strip(),
            f"use {hint.split(chr(39))[1]}=..." if hint else "miles-run --help lists the groups",
        )
    if match := _MISSING_RE.search(message):
        group, option = match.groups()
        options = group_options(sources or config_sources(), group)
        hint = did_you_mean(option, options) or "options: " + ", ".join(options)
        fix = f"{group}={hint.split(chr(39))[1]}" if hint.startswith("did") else ""
        if group == "recipe":
            fix = f"+recipe={fix.partition('=')[2]}" if fix else _MISSING_RECIPE_HINT
        return Problem("unknown-option", [(f"{group}={option}", COMMAND_LINE)], f"no such option; {hint}", fix)
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()] or ["composition failed"]
    return Problem("config-composition", [], " ".join(lines), "")
