"""A colocated run under offload: every step's calls in the order of miles' train.py (generate -> offload the rollout
-> train -> offload the trainer -> onload the weights -> update the weights -> onload the KV cache), the memory the
engine gives back and takes again, and each push verified once the engine is whole again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_runner.loops.run import run_plan
from miles_runner.loops.step_offload import OFFLOAD_EVENTS_FILE
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
    assert all(r["offload/seconds"] > 0 and r["offload/engine_freed_mb"] > 1 for r in records)  # weights and KV
    assert all(r["offload/trainer_moved_mb"] == 0 for r in records)  # the trainer stays


TRAINER_ORDER = ["offload_rollout", "onload_train", "offload_train", "onload_weights", "update_weights", "onload_kv"]
MEGATRON_OFFLOAD = ("trainer=megatron", "lora_mode=raw", "topology.offload_train=true", "trainer.offload_target=disk")


@pytest.fixture(scope="module")
def trainer_offloaded_run(tmp_path_factory) -> tuple[list[dict], list[dict], Path]:
    scratch = tmp_path_factory.mktemp("scratch")
    chunks = ("trainer.offload_disk_chunk_mb=1", "checkpoint.interval=2")  # the tiny model's state: about 1.1 MB
    overrides = (*MEGATRON_OFFLOAD, f"trainer.offload_disk_dir={scratch}", *chunks)
    run_dir = recorded_run(tmp_path_factory.mktemp("trainer-offload"), BASE, *overrides)
    records = run_plan(read_plan(run_dir / "plan.yaml"), run_dir)
    events = [json.loads(line) for line in (run_dir / OFFLOAD_EVENTS_FILE).read_text().splitlines()]
    return records, events, scratch


def test_the_megatron_trainer_leaves_after_training_and_before_the_engines_take_their_weights_back(
    trainer_offloaded_run,
):
    records, events, scratch = trainer_offloaded_run
    calls = [(e["iteration"], e["event"]) for e in events]
    # A checkpoint (after steps 2 and 3) needs the trainer's state: it comes back for the save and leaves again;
    # after the last step it comes back for good.
    expected = [(step, name) for step in range(STEPS) for name in TRAINER_ORDER]
    expected.insert(expected.index((2, "offload_rollout")), (1, "offload_train"))
    expected += [(STEPS - 1, "offload_train"), (STEPS, "onload_train")]
    assert calls == expected
    moved = [e["moved_bytes"] for e in events if e["event"] == "offload_train"]
    assert all(m == moved[0] > 2**20 for m in moved) and all(e["target"] == "disk" for e in events if "target" in e)
    assert all(e["chunks"] == 2 for e in events if e["event"] == "offload_train")  # 1 MB chunks
    assert not list(scratch.rglob("*.safetensors"))  # the chunks are gone once the state is back
    assert all(r["verify/logprob_gap"] <= 0.01 for r in records)  # probed with the trainer's logprobs before it left
    assert all(r["offload/trainer_moved_mb"] > 1 for r in records)  # its frozen weights, gradients, Adam state
