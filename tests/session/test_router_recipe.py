"""`miles-run +recipe=tiny_lora_agentic_router` end to end: two embedded engines behind the real sglang-router,
the session server pinning each session to one of them, incremental R3 replayed by the trainer. It completes,
learns, and both engines served the agents' turns.

Nothing is lost on the way: the trainer refuses a sample whose routing rows are not exactly len(tokens) - 1
(trainer/routing_replay.py) or whose logprobs do not cover its response, so a completed run means every sample
carried all of them; and the trainer's own logprobs, computed with the replayed routing, matching the engines'
to 1e-3 on every step means tokens, logprobs and routing rows line up. The session-level lengths are compared
directly in test_behind_router.py. This is also the proof that R3-replayed training learns for the single-engine
twin `tiny_r3_session` (same settings; tests/trainer/test_r3_recipe.py runs it short).
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from miles_runner.plan.record import read_plan
from tests.drivers import runner_command
from tests.loops.recipe_runs import LEARNING_RUN, LEARNING_STEPS, MARGIN, gain

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
ENGINES = 2


def test_the_router_recipe_runs_learns_and_spreads_sessions_over_both_engines(tmp_path):
    args = [
        "+recipe=tiny_lora_agentic_router",
        f"run.output_root={tmp_path}",
        "logger=none",
        LEARNING_RUN,
    ]
    done = subprocess.run(
        runner_command("miles_runner.cli.main", *args),
        capture_output=True,
        text=True,
        timeout=2350,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [run_dir] = {path.parent for path in tmp_path.rglob("plan.yaml")}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert len(steps) == read_plan(run_dir / "plan.yaml").batch.num_steps == LEARNING_STEPS
    assert gain([step["reward/mean"] for step in steps]) >= MARGIN, [step["reward/mean"] for step in steps]
    assert all(step["train/rollout_logprob_abs_diff"] < 1e-3 for step in steps)
    assert all("train/routing_replay_diff_frac" in step for step in steps)  # R3 was replayed on every step

    # The engines' own access logs: every /generate an engine answered in an agentic run is a session turn.
    turns = [engine_generate_calls(run_dir / "logs" / f"engine{i}.log") for i in range(ENGINES)]
    assert min(turns) >= sum(turns) / (2 * ENGINES), turns  # each session pinned to the less loaded engine


def engine_generate_calls(log: Path) -> int:
    return sum('"POST /generate HTTP/1.1" 200' in line for line in log.read_text().splitlines())
