"""The proof: the default recipe (`make run`) learns on CPU, and does not when rollouts miss the adapter.

Both runs are the default recipe through the real engine, session server and OpenAI-client agent. The second
sets the named fault switch that keeps the engines on the initial (identity) adapter, so its rollouts never
use what was trained: if the first run's gain came from anywhere else, the second would show it too. That
control run turns push verification off explicitly (weight_sync.verify=false): with it on, as by default, the
same fault stops the run at the first push after step 0, whose probe differs from the trainer (weight_sync/probe.py),
before the trainer trains further: under the sync and the async schedule alike.

The learning run takes the recipe's first 35 steps (recipe_runs.LEARNING_STEPS). The control runs 20: its rollouts
come from the same frozen adapter at every step, so its reward is one distribution throughout, and `gain` (the mean of
the last 10 steps minus that of the first 10) measures the same thing with the same noise over 20 steps as over 40.
"""

from pathlib import Path

import pytest

from tests.loops.recipe_runs import LEARNING_RUN, MARGIN, WINDOW, gain, miles_run, run_default_recipe

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_default_recipe_learns_only_when_rollouts_use_the_trained_adapter(tmp_path):
    learned = run_default_recipe(tmp_path / "adapter", LEARNING_RUN, fault=False)
    frozen = run_default_recipe(tmp_path / "frozen", f"algorithm.num_steps={2 * WINDOW}", fault=True)
    print(
        f"gain with the adapter {gain(learned):+.3f}, with rollouts frozen on the initial adapter {gain(frozen):+.3f}"
    )
    assert gain(learned) >= MARGIN, learned
    assert gain(frozen) < MARGIN, frozen
    assert gain(learned) - gain(frozen) >= MARGIN


def assert_stopped_at_the_push_after_step_0(root: Path, *overrides: str) -> None:
    done = miles_run(root, "checkpoint.interval=1", *overrides, fault=True)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    [error] = [line for line in done.stderr.splitlines() if "SyncVerificationError: the push after step 0:" in line]
    print(error)
    assert "the probe of adapter" in error and "weight_sync.max_logprob_gap=0.01: engine http://127.0.0.1:" in error
    [run_dir] = {p.parent for p in root.rglob("plan.yaml")}
    # Step 0 trained the adapter whose push failed; the run stopped there: no step recorded, none checkpointed.
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert not (run_dir / "adapter").exists()


def test_a_frozen_adapter_stops_the_verified_run_before_the_trainer_steps_on_its_rollouts(tmp_path):
    assert_stopped_at_the_push_after_step_0(tmp_path)


def test_a_frozen_adapter_stops_the_async_schedule_at_its_first_push_after_step_0(tmp_path):
    assert_stopped_at_the_push_after_step_0(
        tmp_path,
        "topology=disaggregated",
        "topology.actor_num_gpus_per_node=1",
        "rollout.schedule=async",
        "rollout.max_weight_staleness=1",
        "algorithm.use_tis=true",
    )
