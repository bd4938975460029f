"""A multi-LoRA run with two trainer ranks (the driver is rank 0, a follower process rank 1): data parallel
multi-LoRA training end to end, each adapter to its num_step, with DP-split batches (spec §4.6)."""

from __future__ import annotations

import pytest

from miles_runner.plan.record import read_plan

from .runs import events, metrics, plan_run, start_driver

pytestmark = pytest.mark.slow

RUNS = "adapters.runs=[{name: count, task: count}, {name: arith, task: arith}]"
STEPS = 3


def test_a_multi_lora_run_trains_on_two_trainer_ranks(tmp_path):
    run_dir = plan_run(
        tmp_path / "outputs",
        RUNS,
        "cluster.cpu_devices_per_node=3",
        "topology.actor_num_gpus_per_node=2",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        f"algorithm.num_steps={STEPS}",
    )
    assert read_plan(run_dir / "plan.yaml").trainer.parallel.dp == 2
    proc = start_driver(run_dir)
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out[-4000:]
    records = metrics(run_dir)
    assert {max(r[f"{n}/step"] for r in records if f"{n}/step" in r) for n in ("count", "arith")} == {STEPS}
    assert all(r["batch/samples"] % 2 == 0 for r in records)  # whole DP splits
    assert events(run_dir, "trained")
    follower_log = (run_dir / "logs" / "trainer1.log").read_text()
    assert "failed" not in follower_log, follower_log[-2000:]
