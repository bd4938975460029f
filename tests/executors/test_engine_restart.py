"""An engine that dies mid-run is started again on its port, registered with the router again, and the run's
restart budget (`executor.engine_restarts`) is enforced with an error that names the setting."""

import os
import signal
import time

import httpx
import pytest

from miles_runner.executors.local import EngineLostError, LocalExecutor
from miles_runner.sglang_client.router import ensure_worker

from .test_local_executor import tiny_plan, wait_gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.integration]


def kill_engine(executor: LocalExecutor, index: int) -> int:
    """Injected fault: SIGKILL the engine's whole process group, as an OOM kill would."""
    engine = executor.engines[index]
    os.killpg(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.alive:  # a killed multi-threaded process is a zombie a little before it can be reaped
        assert time.monotonic() < deadline, "the killed engine was never reaped"
        time.sleep(0.05)
    return engine.pid


def generate(url: str) -> dict:
    body = {"text": "1 2 3", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    reply = httpx.post(f"{url}/generate", json=body, timeout=60, trust_env=False)
    reply.raise_for_status()
    return reply.json()


def router_engines(url: str) -> set[str]:
    body = httpx.get(f"{url}/workers", timeout=10, trust_env=False).json()
    return {w["url"].rstrip("/") for w in body["workers"]}


def test_a_dead_engine_comes_back_on_its_port_behind_the_router_until_the_budget_is_spent(tmp_path):
    plan = tiny_plan("router=sglang", "topology.actor_num_gpus_per_node=2", "executor.engine_restarts=1")
    executor = LocalExecutor(plan, tmp_path, startup_timeout_s=180)
    with executor as deployment:
        assert executor.restart_dead_engines() == []

        old_pid = kill_engine(executor, 0)
        assert executor.restart_dead_engines() == [0]
        new = executor.engines[0]
        assert new.pid != old_pid and new.alive
        assert generate(deployment.engine_urls[0])["meta_info"]["completion_tokens"] == 2
        assert router_engines(deployment.rollout_url) == set(deployment.engine_urls)
        assert new in executor.group.processes  # so it is stopped with the others

        kill_engine(executor, 0)
        with pytest.raises(EngineLostError, match=r"engine0: .* executor\.engine_restarts=1 restart\(s\) are used up"):
            executor.restart_dead_engines()
        replacement_pid = new.pid
    assert wait_gone([p.pid for p in executor.engines.values()] + [replacement_pid]) == []


def test_a_worker_the_router_dropped_is_registered_again(tmp_path):
    plan = tiny_plan("router=sglang", "topology.actor_num_gpus_per_node=2")
    with LocalExecutor(plan, tmp_path, startup_timeout_s=180) as deployment:
        router, worker = deployment.rollout_url, deployment.engine_urls[1]
        listed = httpx.get(f"{router}/workers", timeout=10, trust_env=False).json()["workers"]
        [worker_id] = [w["id"] for w in listed if w["url"].rstrip("/") == worker]
        removed = httpx.delete(f"{router}/workers/{worker_id}", timeout=10, trust_env=False)
        assert removed.is_success, removed.text
        deadline = time.monotonic() + 30
        while worker in router_engines(router):
            assert time.monotonic() < deadline, "the router kept the worker it was told to remove"
            time.sleep(0.2)
        ensure_worker(router, worker, timeout_s=60)
        assert router_engines(router) == set(deployment.engine_urls)
