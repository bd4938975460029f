"""An engine killed mid-run (SIGKILL, as an OOM kill would) is restarted by the driver and receives every
loaded adapter again, including one that has not stepped since (spec §4.7 `select_adapters_to_push`: all
loaded adapters when the engines are new); training then carries on to each adapter's num_step. The run is
agentic: episodes go through the session server, bound to each adapter's slot."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from miles_runner.core.adapters import slot_lora_name
from miles_runner.loops.multi_lora import MultiLoRALoop
from miles_runner.plan.record import read_plan
from miles_runner.procs.ports import free_port

from .runs import events, metrics, plan_run, start_driver, wait_for

pytestmark = pytest.mark.slow

NAMES = ("count", "retry")
RUNS = "adapters.runs=[{name: count, task: count}, {name: retry, task: count_retry}]"
STEPS = 5


def engine_pid(port: int) -> int:
    """The embedded engine serving `port` (a grandchild of the test: found by its command line)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, PermissionError, NotADirectoryError):
            continue
        if b"miles_runner.embedded_engine" in argv and str(port).encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no engine process on port {port}")


def trained_iterations(run_dir: Path, name: str) -> list[int]:
    return [e["iteration"] for e in events(run_dir, "trained") if any(g[0] == name for g in e["groups"])]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = plan_run(
        tmp_path_factory.mktemp("restart") / "outputs",
        RUNS,
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        f"algorithm.num_steps={STEPS}",
        "executor.engine_restarts=1",
        "session=v1",  # the engine restarts behind the session server; retry's episodes are two turns
        f"session.port={free_port()}",
        "rollout.max_turns=2",
        "adapters.max_empty_wait_s=3",
    )
    port = read_plan(run_dir / "plan.yaml").engines[0].launch.port
    proc = start_driver(run_dir)
    try:
        wait_for(lambda: all(trained_iterations(run_dir, n) for n in NAMES), proc, timeout_s=240)
        os.killpg(engine_pid(port), signal.SIGKILL)
        out, _ = proc.communicate(timeout=400)
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return run_dir


def test_the_dead_engine_is_restarted_once(run_dir):
    assert [e["engines"] for e in events(run_dir, "engines_restarted")] == [[0]]


def test_the_restarted_engine_receives_every_loaded_adapter(run_dir):
    restarted_at = events(run_dir, "engines_restarted")[0]["iteration"]
    [after] = [e for e in events(run_dir, "pushed_all") if e["iteration"] == restarted_at]
    assert after["names"] == sorted(NAMES)
    slots = sorted(slot_lora_name(e["slot"]) for e in events(run_dir, "loaded"))
    assert after["engine_adapters"] == [slots]  # what the new engine lists in /v1/models


def test_retry_plays_two_turn_episodes_through_the_session_server(run_dir):
    turns = [r["retry/rollout/turns_mean"] for r in metrics(run_dir) if "retry/rollout/turns_mean" in r]
    assert turns and max(turns) > 1.0
    assert all(r.get("count/rollout/turns_mean", 1.0) == 1.0 for r in metrics(run_dir))  # count: one answer


def test_training_carries_on_after_the_restart_to_each_num_step(run_dir):
    restarted_at = events(run_dir, "engines_restarted")[0]["iteration"]
    for name in NAMES:
        assert max(trained_iterations(run_dir, name)) >= restarted_at
        assert max(r[f"{name}/step"] for r in metrics(run_dir) if f"{name}/step" in r) == STEPS


class KillEngineAsThirdPushStarts(MultiLoRALoop):
    """Fault injection: SIGKILL the engine just as a weight push starts (after the check for dead engines),
    so the push itself meets the dead engine."""

    killed = False

    async def _update_weights(self, parts, iteration: int) -> float:
        if not self.killed and iteration >= 2:
            self.killed = True
            os.killpg(self.executor.engines[0].pid, signal.SIGKILL)
        return await super()._update_weights(parts, iteration)


def test_an_engine_that_dies_during_a_push_is_restarted_and_given_every_adapter(tmp_path):
    run_dir = plan_run(
        tmp_path / "outputs",
        RUNS,
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "algorithm.num_steps=3",
        "executor.engine_restarts=1",
        "logger=none",
    )
    driver = KillEngineAsThirdPushStarts(read_plan(run_dir / "plan.yaml"), run_dir)
    driver.run()
    assert driver.killed
    [restart] = events(run_dir, "engines_restarted")
    pushed_all = [e for e in events(run_dir, "pushed_all") if e["iteration"] >= restart["iteration"]]
    assert pushed_all and pushed_all[0]["names"] == sorted(NAMES)
    assert all(max(r[f"{n}/step"] for r in metrics(run_dir) if f"{n}/step" in r) == 3 for n in NAMES)
