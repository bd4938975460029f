"""A colocated run under rollout offload: every step's engine calls in the order of miles' train.py (generate ->
offload the rollout -> train -> onload the weights -> update the weights -> onload the KV cache), the memory the
engine gives back and takes again, and each push verified once the engine is whole again."""

from __future__ import annotations

import json

import pytest

from miles_runner.loops.engine_offload import OFFLOAD_EVENTS_FILE
from miles_runner.loops.run import run_plan
from miles_runner.plan.record import read_plan

from .recipe_runs import recorded_run

pytestmark = pytest.mark.integration

STEPS = 3
ORDER = ["offload_rollout", "onload_weights", "update_weights", "onload_kv"]  # docs/system.md §7, per step
BASE = (
    "+recipe=tiny_lora_agentic",
    "session=off",
    "rollout.max_turns=1",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=2",
    f"algorithm.num_steps={STEPS}",
    "topology.offload_rollout=true",
    "logger=none",
)


@pytest.fixture(scope="module")
def offloaded_run(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    run_dir = recorded_run(tmp_path_factory.mktemp("offload"), BASE)
    records = run_plan(read_plan(run_dir / "plan.yaml"), run_dir)
    events = [json.loads(line) for line in (run_dir / OFFLOAD_EVENTS_FILE).read_text().splitlines()]
    return records, events


def test_each_step_offloads_and_onloads_in_the_order_of_the_colocated_loop(offloaded_run):
    _, events = offloaded_run
    assert [(e["iteration"], e["event"]) for e in events] == [(step, name) for step in range(STEPS) for name in ORDER]
    assert [e["version"] for e in events if e["event"] == "update_weights"] == list(range(1, STEPS + 1))
    releases = [e for e in events if e["event"] == "offload_rollout"]
    assert all(e["tags"] == ["cuda_graph", "kv_cache", "weights"] for e in releases)  # the default level


def test_the_engine_gives_its_weights_back_while_the_trainer_trains_and_takes_them_again(offloaded_run):
    _, events = offloaded_run
    for step in range(STEPS):
        released, weights_back, _, whole = (e for e in events if e["iteration"] == step)
        [engine] = released["engines"]
        assert engine["released"] == ["cuda_graph", "kv_cache", "weights"] and engine["freed_bytes"]["weights"] > 0
        [after] = weights_back["engines"]
        assert after["released"] == ["cuda_graph", "kv_cache"]  # the KV cache comes back after the push
        assert after["rss_bytes"] > engine["rss_bytes"]  # the reloaded weights are resident again
        assert whole["engines"] == [{"released": [], "freed_bytes": {}, "rss_bytes": whole["engines"][0]["rss_bytes"]}]


def test_every_push_after_an_onload_passes_the_probe_and_the_step_records_the_offload_time(offloaded_run):
    records, _ = offloaded_run
    assert [r["weight_version"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["verify/logprob_gap"] <= 0.01 for r in records)  # the plan's bound for the embedded engine
    assert all(r["offload/seconds"] > 0 for r in records)
