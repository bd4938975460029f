"""Rollout offload in the plan: the tags the engines release (miles' --offload-rollout-level), the flags that make
them give memory back, and what the summary says it frees on a CPU host."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.summary import summarize

OFFLOAD = ("+recipe=tiny_lora_agentic", "topology.offload_rollout=true")


def test_the_default_level_releases_the_graphs_the_kv_cache_and_the_weights():
    plan = compile_plan(compose([*OFFLOAD]))
    assert plan.weight_sync.offload_tags == ["cuda_graph", "kv_cache", "weights"]
    assert "--enable-memory-saver" in plan.engines[0].launch.argv  # the embedded engine gives memory back with it


def test_a_level_without_the_weights_keeps_them_resident():
    plan = compile_plan(compose([*OFFLOAD, "topology.offload_rollout_level=[kv_cache]"]))
    assert plan.weight_sync.offload_tags == ["cuda_graph", "kv_cache"]


def test_without_rollout_offload_the_engines_stay_resident():
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic"]))
    assert plan.weight_sync.offload_tags == [] and "--enable-memory-saver" not in plan.engines[0].launch.argv


def test_a_level_outside_miles_values_is_refused_naming_the_field():
    with pytest.raises(PlanError, match=r"(?s)topology\.offload_rollout_level\[0\].*'kv_cache' or 'weight'"):
        compose([*OFFLOAD, "topology.offload_rollout_level=[weights]"])


def test_the_cpu_summary_says_what_offload_frees_there():
    plain = summarize(compile_plan(compose([*OFFLOAD])), "plan.yaml")
    assert "engines release cuda_graph, kv_cache, weights after each rollout" in plain
    assert "by reloading the model path" in plain and "no CUDA graphs on CPU" in plain
    backup = summarize(compile_plan(compose([*OFFLOAD, "adapters.base_cpu_backup=true"])), "plan.yaml")
    assert "only the KV cache is freed" in backup
