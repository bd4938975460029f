"""The CPU twin of qwen3_30b_a3b_r3_session (`tiny_r3_session`: session v1, in_place, routing replay on) runs
end to end and learns, replaying the session's incremental R3 in every training step."""

import json

import pytest
from loops.test_learning import MARGIN, gain, run_default_recipe

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan

RECIPE = "tiny_r3_session"


def test_the_twin_plans_incremental_r3_replayed_by_the_trainer():
    plan = compile_plan(compose([f"+recipe={RECIPE}"]))
    assert plan.capabilities.use_routing_replay and plan.capabilities.use_addition_r3
    assert plan.session.version == "v1" and plan.sync.pause_generation_mode == "in_place"
    assert "--enable-return-routed-experts" in plan.engines[0].launch.argv
    assert "--addition-r3" in plan.session.launch.argv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_r3_twin_learns_and_logs_the_replayed_routing_every_step(tmp_path):
    rewards = run_default_recipe(tmp_path, fault=False, recipe=RECIPE)
    [metrics] = tmp_path.rglob("metrics.jsonl")
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    print(f"gain {gain(rewards):+.3f}; routing_replay_diff_frac per step "
          f"{[round(s['train/routing_replay_diff_frac'], 4) for s in steps]}")  # fmt: skip
    assert len(steps) == 40
    assert all(0.0 <= s["train/routing_replay_diff_frac"] <= 1.0 for s in steps)
    assert gain(rewards) >= MARGIN, rewards
