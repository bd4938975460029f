"""The Ray executor: a real local Ray on loopback runs the plan's servers under an actor and stops them all."""

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.ray import RayExecutor
from miles_runner.plan.compile import compile_plan
from miles_runner.procs.ports import port_is_free

pytestmark = pytest.mark.slow


def pid_alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def restart_when_reaped(executor: RayExecutor, timeout_s: float = 30) -> list[int]:
    """A killed multi-threaded engine is a zombie a little before its parent (the actor) can reap it."""
    deadline = time.monotonic() + timeout_s
    while not (restarted := executor.restart_dead_engines()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return restarted


@pytest.mark.timeout(300)
def test_ray_executor_serves_the_plan_restarts_a_dead_engine_and_stops_every_process(tmp_path):
    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", "Ray must stay on loopback in tests"
    # Ports chosen at start (the default), by the node agent just before each server binds: a port picked here stays
    # free for any process on the host through Ray's start and the engine's, long enough on a loaded machine for a
    # server of another test to take it.
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic", "executor=ray", "executor.engine_restarts=1"]))
    executor = RayExecutor(plan, tmp_path, startup_timeout_s=180)
    with executor as deployment:
        pids, engine_port = executor.pids, deployment.plan.engines[0].launch.port
        assert len(pids) == 2
        assert httpx.get(deployment.rollout_url + "/health", timeout=10).status_code == 200
        assert httpx.get(deployment.session_url + "/health", timeout=10).status_code == 200
        os.killpg(pids[0], signal.SIGKILL)  # injected fault: the engine dies
        assert restart_when_reaped(executor) == [0]
        assert httpx.get(deployment.rollout_url + "/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 20
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(pid_alive(p) for p in pids)
    assert port_is_free("127.0.0.1", engine_port), "the restarted engine outlived the run"
