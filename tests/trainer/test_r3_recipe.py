"""The CPU twin of qwen3_30b_a3b_r3_session (`tiny_r3_session`: session v1, in_place, routing replay on) runs
end to end, replaying the session's incremental R3 in every training step with the engine's logprobs.

That R3-replayed training also learns is proven by the router recipe (tests/session/test_router_recipe.py), whose
settings are this twin's (session v1, in_place, routing replay, the same task, batch, lr and 40 steps) with two
engines behind the router; this run is kept short (its 40-step learning run took 125 s of the suite)."""

import json

import pytest
from loops.test_learning import run_default_recipe

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan

RECIPE = "tiny_r3_session"
STEPS = 6


def test_the_twin_plans_incremental_r3_replayed_by_the_trainer():
    plan = compile_plan(compose([f"+recipe={RECIPE}"]))
    assert plan.capabilities.use_routing_replay and plan.capabilities.use_addition_r3
    assert plan.session.version == "v1" and plan.weight_sync.pause_generation_mode == "in_place"
    assert "--enable-return-routed-experts" in plan.engines[0].launch.argv
    assert "--addition-r3" in plan.session.launch.argv


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_r3_twin_replays_the_sessions_routing_every_step_matching_the_engines_logprobs(tmp_path):
    run_default_recipe(tmp_path, f"algorithm.num_steps={STEPS}", fault=False, recipe=RECIPE)
    [metrics] = tmp_path.rglob("metrics.jsonl")
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    print(
        f"routing_replay_diff_frac per step {[round(s['train/routing_replay_diff_frac'], 4) for s in steps]}; "
        f"logprob gap {[s['train/rollout_logprob_abs_diff'] for s in steps]}"
    )
    assert len(steps) == STEPS
    assert all(0.0 <= s["train/routing_replay_diff_frac"] <= 1.0 for s in steps)
    # The trainer's logprobs under the replayed routing are the engine's: tokens, logprobs and R3 rows line up.
    assert all(s["train/rollout_logprob_abs_diff"] < 1e-3 for s in steps)
