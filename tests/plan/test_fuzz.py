"""Override fuzz: any combination of group options and values yields a Plan or a PlanError whose every problem names
its rule, and nothing else (any other exception, a traceback to the user, fails the test).

1,000 seeded override sets (Hypothesis, derandomized: the same sets on every run). Each is a base, a recipe and up
to two group options from a fixed pool, plus up to five ordinary value overrides and at most one odd one (a wrong
type, NaN, null, a list): with more, nearly every set stops at the schema and few reach the plan rules.

Hydra composes each base once, through the real `compose()` (a composition is slow: 1,000 would take
minutes). The value overrides are then applied as Hydra applies an override of an existing key (the value parsed by
Hydra's override grammar and set in place) to the base's composed values, which the schema validates again
(`from_composed`, with provenance): every set goes through the schema's checks and every plan rule. No key fuzzed
here is an interpolation source in a shipped config, so setting it after composition is what Hydra would have
composed (checked below).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_runner.config.compose import CONF_DIR, RECIPES_DIR, ComposedConfig, from_composed
from miles_runner.config.provenance import flatten
from miles_runner.config.schema import defaults_tree
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan

EXAMPLES = 1000
SEED = 15
GROUPS = {
    p.name: sorted(f.stem for f in p.glob("*.yaml")) for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "recipe"
}
RECIPES = sorted(p.stem for p in Path(RECIPES_DIR).glob("*.yaml"))
NUMBERS = ("0", "1", "2", "3", "4", "8", "16", "-1")
ODD = ("x", "true", "1.5", "null", "[1]", "1e9", "nan")
KEYS = [
    "trainer.parallel.tp",
    "trainer.parallel.pp",
    "trainer.parallel.ep",
    "trainer.parallel.cp",
    "engine.tp_size",
    "engine.ep_size",
    "topology.actor_num_gpus_per_node",
    "topology.rollout_num_gpus",
    "cluster.nodes",
    "cluster.gpus_per_node",
    "rollout.n_samples_per_prompt",
    "rollout.rollout_batch_size",
    "adapters.rank",
    "algorithm.global_batch_size",
    "rollout.max_weight_staleness",
    "adapters.max_slots",
    "session.port",
    "executor.engine_restarts",
    "checkpoint.interval",
]
FLAGS = [
    "rollout.fully_async",
    "rollout.routing_replay",
    "rollout.partial_rollout",
    "adapters.train_only",
    "trainer.calculate_per_token_loss",
    "rollout.group_rm",
    "cluster.cpu_only",
]
# The run's key and limits, fuzzed once the schema has them: (ordinary values, odd values).
NEW_SETTINGS = {
    "security.api_key_env": (("", "MILES_FUZZ_KEY", "HOME"), ("x y", "1", "null", "$KEY")),
    "engine.max_n": (NUMBERS, ODD),
    "engine.max_batch_size": (NUMBERS, ODD),
    "session.max_sessions": (NUMBERS, ODD),
    "session.max_age_s": (NUMBERS, ODD),
}
SCHEMA_PATHS = set(flatten(defaults_tree()))
CHOICES = {
    **dict.fromkeys(KEYS, (NUMBERS, ODD)),
    **dict.fromkeys(FLAGS, (("true", "false"), ("maybe", "1.5"))),
    **{k: v for k, v in NEW_SETTINGS.items() if k in SCHEMA_PATHS},
}
PARSER = OverridesParser.create()


def base_pool(size: int = 32) -> list[tuple[str, ...]]:
    """No recipe, each recipe alone, then seeded draws of a recipe (or none) with one or two group options."""
    rng = random.Random(SEED)
    pool = {(): None, **{(f"+recipe={r}",): None for r in RECIPES}}
    while len(pool) < size:
        recipe = rng.choice([None, *RECIPES])
        groups = rng.sample(sorted(GROUPS), rng.randint(1, 2))
        head = [f"+recipe={recipe}"] if recipe else []
        pool[(*head, *(f"{g}={rng.choice(GROUPS[g])}" for g in groups))] = None
    return list(pool)


BASES = base_pool()


def with_values(base: ComposedConfig, overrides: list[str]) -> ComposedConfig:
    """`base` with each `key=value` set as Hydra sets an existing key, validated again by the schema."""
    tree = dataclasses.asdict(base.config)
    for override in PARSER.parse_overrides(overrides):
        *parents, leaf = override.key_or_group.split(".")
        node = tree
        for parent in parents:
            node = node[parent]
        assert leaf in node, f"{override.key_or_group} is not a key of the composed config"
        node[leaf] = override.value()
    choices = dict(base.provenance.choices)
    return from_composed(tree, choices, [*base.overrides, *overrides], base.searchpath, base.run_dir)


def value_override(odd: bool) -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(CHOICES)).flatmap(
        lambda key: st.sampled_from(CHOICES[key][odd]).map(lambda value: f"{key}={value}")
    )


value_overrides = st.tuples(st.lists(value_override(False), max_size=5), st.lists(value_override(True), max_size=1))
override_sets = st.tuples(st.sampled_from(BASES), value_overrides.map(lambda drawn: drawn[0] + drawn[1]))


def assert_named_rejection(error: PlanError) -> None:
    assert error.problems, "a PlanError always carries at least one problem"
    assert all(p.rule and p.reason for p in error.problems), error


def test_no_fuzzed_key_is_an_interpolation_source_in_a_shipped_config():
    texts = [p.read_text() for p in [*CONF_DIR.rglob("*.yaml"), *Path(RECIPES_DIR).glob("*.yaml")]]
    assert not [key for key in CHOICES if any("${" + key + "}" in text for text in texts)]


def test_the_new_settings_that_exist_are_fuzzed():
    assert {k for k in NEW_SETTINGS if k in SCHEMA_PATHS} <= set(CHOICES)
    assert "security.api_key_env" in CHOICES


@pytest.mark.reliability
@settings(
    max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
@given(override_sets)
def test_any_override_combination_gives_a_plan_or_a_plan_error_naming_its_rule(
    composed: Callable[[tuple[str, ...]], ComposedConfig | PlanError], drawn: tuple[Any, list[str]]
) -> None:
    base, values = drawn
    result = composed(base)
    if isinstance(result, PlanError):
        assert_named_rejection(result)
        return
    try:
        plan = compile_plan(with_values(result, values))
    except PlanError as error:
        assert_named_rejection(error)
        return
    assert isinstance(plan, Plan)
    assert plan.engines, "a valid plan starts at least one engine"
