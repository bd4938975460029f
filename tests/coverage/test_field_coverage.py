"""Every schema field is executed or refused: a field with neither a behaviour test nor a refusing
rule fails here, so a new field cannot slip in unhonoured."""

from __future__ import annotations

import ast
import dataclasses
from functools import cache
from pathlib import Path

import pytest

from miles_runner.config.schema import AdapterEntry, MilesConfig
from miles_runner.core.errors import PlanError
from tests.compiled import compile_overrides
from tests.coverage.evidence import Refused, Runs
from tests.coverage.fields import FIELDS

ROOT = Path(__file__).resolve().parents[2]


def schema_fields(cls: type = MilesConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field; the items of `adapters.runs` as `adapters.runs[].<field>`."""
    paths = []
    for field in dataclasses.fields(cls):
        factory = field.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            paths += schema_fields(factory, f"{prefix}{field.name}.")
        else:
            paths.append(f"{prefix}{field.name}")
    return paths


ALL_FIELDS = [*schema_fields(), *schema_fields(AdapterEntry, "adapters.runs[].")]


def test_every_schema_field_has_evidence_and_no_entry_is_stale():
    missing = [path for path in ALL_FIELDS if path not in FIELDS]
    stale = [path for path in FIELDS if path not in ALL_FIELDS]
    assert not missing, f"schema fields with no evidence in tests/coverage/fields.py: {missing}"
    assert not stale, f"entries for fields the schema does not have: {stale}"


@cache
def functions_in(test_file: str) -> frozenset[str]:
    tree = ast.parse((ROOT / test_file).read_text())
    return frozenset(
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    )


RUNS = [(path, e) for path, evidence in FIELDS.items() for e in evidence if isinstance(e, Runs)]
REFUSALS = [(path, e) for path, evidence in FIELDS.items() for e in evidence if isinstance(e, Refused)]


@pytest.mark.parametrize(("path", "evidence"), RUNS, ids=[p for p, _ in RUNS])
def test_a_field_the_runtime_acts_on_names_existing_behaviour_tests(path, evidence):
    assert evidence.tests, f"{path}: acted on by the runtime, but no behaviour test is named"
    for node_id in evidence.tests:
        test_file, _, name = node_id.partition("::")
        assert (ROOT / test_file).is_file(), f"{path}: {test_file} does not exist"
        assert name.split("[")[0] in functions_in(test_file), f"{path}: {node_id} does not exist"


def rules_raised(overrides: tuple[str, ...]) -> dict[str, str]:
    """rule id -> the settings it names, for the problems these overrides raise (memoised with the rule tables'
    outcomes, which compose the same configs: tests/compiled.py)."""
    result = compile_overrides(overrides)
    if isinstance(result, PlanError):
        return {p.rule: " ".join(setting for setting, _ in p.settings) for p in result.problems}
    return {}


@pytest.mark.parametrize(("path", "evidence"), REFUSALS, ids=[f"{p}/{e.rule}" for p, e in REFUSALS])
def test_a_refused_value_is_refused_by_its_rule_which_names_the_field(path, evidence):
    assert "[]" not in path, "refusals of adapters.runs items need an item override: add support here"
    assert evidence.rule not in rules_raised(evidence.base), f"{evidence.base} alone raises {evidence.rule}"
    raised = rules_raised((*evidence.base, f"{path}={evidence.value}"))
    assert evidence.rule in raised, f"{path}={evidence.value} on {evidence.base} raised {sorted(raised)}"
    group = path.split(".")[0]
    named = raised[evidence.rule]
    assert f"{path}=" in named or named.startswith(f"{group}=") or f" {group}=" in named, (
        f"{evidence.rule} does not name {path}: {named}"
    )
