"""Every recipe's design compiles and matches the reviewed golden file (UPDATE_GOLDEN=1 rewrites them); a recipe
either runs on this release (compile_plan) or is refused only by the NOT_BUILT rules, which name what is missing."""

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from miles_runner.config.compose import RECIPES_DIR, ComposedConfig
from miles_runner.core.errors import PlanError
from miles_runner.core.paths import cache_dir, package_dir, source_checkout
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import plan_from_dict, plan_to_dict
from miles_runner.plan.rules import NOT_BUILT

GOLDEN = Path(__file__).parent / "golden"
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
TINY_RECIPES = [recipe for recipe in RECIPES if recipe.startswith("tiny_")]  # the CPU recipes: they must run


@pytest.fixture
def recipe_config(composed) -> Callable[[str], ComposedConfig]:
    """The composed recipe (memoised for the session: tests/compiled.py)."""

    def of(recipe: str) -> ComposedConfig:
        result = composed((f"+recipe={recipe}",))
        if isinstance(result, PlanError):
            pytest.fail(f"recipe {recipe} does not compose:\n{result}")
        return result

    return of


def portable(plan_dict: dict) -> str:
    """The plan as YAML with the machine's folders replaced (the model cache by <cache>, the installed package by
    <package>), so goldens hold on any clone and any install."""
    text = yaml.safe_dump(plan_dict, sort_keys=False)
    text = text.replace(str(cache_dir()), "<cache>").replace(str(package_dir()), "<package>")
    checkout = source_checkout()  # a twin's trainer interpreter: .venv-bridge/bin/python in the checkout
    return text.replace(str(checkout), "<checkout>") if checkout else text


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_compiles_to_its_golden_plan(recipe, recipe_config):
    plan = compile_design(recipe_config(recipe))
    text = portable(plan_to_dict(plan))
    golden = GOLDEN / f"{recipe}.yaml"
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        GOLDEN.mkdir(exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_runs_or_is_refused_only_for_what_is_not_built(recipe, recipe_config):
    try:
        compile_plan(recipe_config(recipe))
    except PlanError as error:
        assert {p.rule for p in error.problems} <= set(NOT_BUILT), str(error)
        assert recipe not in TINY_RECIPES, str(error)


@pytest.mark.parametrize("recipe", RECIPES)
def test_plan_round_trips_through_its_dict(recipe, recipe_config):
    plan = compile_design(recipe_config(recipe))
    assert plan_from_dict(yaml.safe_load(yaml.safe_dump(plan_to_dict(plan)))) == plan


def test_the_glm52_recipe_uses_the_spec_figures(recipe_config):
    plan = compile_design(recipe_config("glm52_lora_agentic"))
    assert (plan.cluster.nodes, plan.cluster.gpus_per_node, plan.cluster.gpu_type) == (4, 8, "H200")
    p = plan.trainer.parallel
    assert (p.tp, p.ep, p.pp, p.cp, p.world_size) == (8, 32, 1, 1, 32)
    assert [(a.rank, a.alpha) for a in plan.adapters] == [(16, 32)]
    assert plan.trainer.lora_mode == "bridge" and plan.topology == "colocated"
    assert plan.session and plan.session.lora_name == "miles_lora" and not plan.session.use_addition_r3
    assert [e.tp_size for e in plan.engines] == [16, 16]
    assert "--enable-return-routed-experts" in plan.engines[0].launch.argv


def test_the_qwen3_session_recipe_derives_addition_r3(recipe_config):
    plan = compile_design(recipe_config("qwen3_30b_a3b_r3_session"))
    assert plan.capabilities.use_addition_r3
    assert "--addition-r3" in plan.session.launch.argv


def test_multi_lora_math_has_three_adapters_in_slots(recipe_config):
    plan = compile_design(recipe_config("multi_lora_math"))
    assert [a.lora_name for a in plan.adapters] == ["__miles_slot_0", "__miles_slot_1", "__miles_slot_2"]
    assert plan.topology == "disaggregated" and plan.weight_sync.transfer_mode == "broadcast"
    assert "--max-loras-per-batch" in plan.engines[0].launch.argv


def test_embedded_and_sglang_engines_share_one_argv_shape(recipe_config):
    embedded = compile_design(recipe_config("tiny_lora_agentic")).engines[0].launch.argv
    flags = [a for a in embedded if a.startswith("--")]
    assert embedded[:3] == ["python", "-m", "miles_runner.embedded_engine"]
    assert {"--model-path", "--port", "--enable-lora", "--max-lora-rank", "--lora-target-modules"} <= set(flags)
