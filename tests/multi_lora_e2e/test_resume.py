"""A multi-LoRA run killed with SIGKILL mid-run resumes every adapter from its own latest checkpoint
(adapter, optimizer, step, data cursor), and num_step counts again from the resumed step (spec §4.2)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from miles_runner.loops.checkpoint import completed_steps
from miles_runner.plan.record import read_plan
from miles_runner.procs.ports import port_is_free

from .runs import events, metrics, plan_run, start_driver, wait_for

pytestmark = pytest.mark.slow

NAMES = ("count", "guess")
RUNS = "adapters.runs=[{name: count, task: count}, {name: guess, task: guess_number, reward: guess_number}]"
STEPS = 4


def adapter_steps(run_dir: Path, name: str) -> list[int]:
    return [r[f"{name}/step"] for r in metrics(run_dir) if f"{name}/step" in r]


def wait_ports_free(run_dir: Path, timeout_s: float = 30) -> None:
    plan = read_plan(run_dir / "plan.yaml")
    launches = [plan.multi_lora.launch, *(e.launch for e in plan.engines)]
    deadline = time.monotonic() + timeout_s
    while not all(port_is_free(launch.host, launch.port) for launch in launches):
        assert time.monotonic() < deadline, "the killed run's servers still hold their ports"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    run_dir = plan_run(
        tmp_path_factory.mktemp("resume") / "outputs",
        RUNS,
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        f"algorithm.num_steps={STEPS}",
        "checkpoint.interval=1",
    )
    first = start_driver(run_dir)
    try:
        wait_for(lambda: all(len(adapter_steps(run_dir, n)) >= 2 for n in NAMES), first, timeout_s=240)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    # The killed process may be a warm start's requester, whose driver ends a moment later: read the checkpoints
    # once the driver's servers (which die with it) let go of their ports.
    wait_ports_free(run_dir)
    saved = {name: completed_steps(run_dir / "adapters" / name)[-1] for name in NAMES}
    assert all(0 < step < STEPS for step in saved.values()), saved
    second = start_driver(run_dir, "--resume")
    out, _ = second.communicate(timeout=400)
    assert second.returncode == 0, out[-4000:]
    return run_dir, saved


def test_each_adapter_is_loaded_from_its_latest_checkpoint(resumed):
    run_dir, saved = resumed
    later_loads = {e["name"]: e["resumed_step"] for e in events(run_dir, "loaded") if e["resumed_step"] is not None}
    assert later_loads == saved


def test_resumed_adapters_continue_their_step_count_for_num_step_more_steps(resumed):
    run_dir, saved = resumed
    # The killed run may have logged a step it had not checkpointed yet; the resumed run does that step again.
    resumed_at = min(e["iteration"] for e in events(run_dir, "loaded") if e["resumed_step"] is not None)
    for name in NAMES:
        after = [r[f"{name}/step"] for r in metrics(run_dir) if r["step"] >= resumed_at and f"{name}/step" in r]
        assert after == list(range(saved[name] + 1, saved[name] + STEPS + 1)), adapter_steps(run_dir, name)


def test_checkpoints_carry_the_data_cursor_and_the_iteration_count_continues(resumed):
    run_dir, _ = resumed
    for name in NAMES:
        latest = completed_steps(run_dir / "adapters" / name)[-1]
        meta = json.loads((run_dir / "adapters" / name / "checkpoints" / f"step_{latest}" / "meta.json").read_text())
        assert meta["name"] == name and meta["cursor"] >= latest * 4
    iterations = [r["step"] for r in metrics(run_dir)]
    assert iterations == sorted(set(iterations))
