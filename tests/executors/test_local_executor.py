"""The local executor starts the plan's servers and leaves no process behind: on success, failure and Ctrl-C."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.local import LocalExecutor
from miles_runner.plan.compile import compile_plan
from miles_runner.procs.launch import PortBusyError
from miles_runner.procs.ports import free_port, free_port_block
from miles_runner.procs.process import ProcessStartError

pytestmark = pytest.mark.integration


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def tiny_plan(*extra: str, pinned: bool = False):
    """The tiny plan, its ports chosen at start (`auto`); `pinned`: fixed free ports, for a test that holds one."""
    ports = [f"engine.base_port={free_port_block(2)}", f"router.port={free_port()}"] if pinned else []
    return compile_plan(compose(["+recipe=tiny_lora_agentic", "session=off", *ports, *extra]))


@pytest.mark.timeout(240)
def test_engines_and_router_start_healthy_and_all_stop(tmp_path):
    plan = tiny_plan("router=sglang", "topology.actor_num_gpus_per_node=2")
    assert len(plan.engines) == 2
    with LocalExecutor(plan, tmp_path, startup_timeout_s=180) as deployment:
        pids = [p.pid for p in deployment.processes]
        assert len(pids) == 3
        assert httpx.get(deployment.rollout_url + "/health", timeout=10).status_code == 200
        for url in deployment.engine_urls:
            assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert wait_gone(pids) == []
    assert (tmp_path / "logs" / "engine0.log").exists()


def test_busy_port_fails_before_anything_starts_naming_the_process_that_holds_it(tmp_path):
    plan = tiny_plan(pinned=True)
    import socket

    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", plan.engines[0].launch.port))
        blocker.listen()
        port = plan.engines[0].launch.port
        with pytest.raises(PortBusyError, match=rf"engine0 on 127\.0\.0\.1:{port} \(held by pid {os.getpid()} \("):
            LocalExecutor(plan, tmp_path).start()
    assert not (tmp_path / "logs").exists()


@pytest.mark.timeout(240)
def test_a_component_failing_to_start_stops_the_ones_already_running(tmp_path):
    plan = tiny_plan("session=v1")
    # Injected fault: a session server that exits at once instead of serving.
    broken = dataclasses.replace(plan.session.launch, argv=["python", "-c", "import sys; sys.exit(3)"])
    plan = dataclasses.replace(plan, session=dataclasses.replace(plan.session, launch=broken))
    executor = LocalExecutor(plan, tmp_path, startup_timeout_s=180)
    with pytest.raises(ProcessStartError, match="exit code 3"):
        executor.start()
    engine_log = (tmp_path / "logs" / "engine0.log").read_text()
    assert "miles_runner.embedded_engine" in engine_log
    assert executor.group.processes == ()
    assert not port_in_use(executor.ports["engine0"])


def port_in_use(port: int) -> bool:
    from miles_runner.procs.ports import port_is_free

    return not port_is_free("127.0.0.1", port)


DRIVER = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    from miles_runner.plan.record import read_plan
    from miles_runner.executors.local import LocalExecutor
    with LocalExecutor(read_plan(sys.argv[1]), Path(sys.argv[2]), startup_timeout_s=180) as deployment:
        print(json.dumps([p.pid for p in deployment.processes]), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_process(tmp_path):
    import yaml

    from miles_runner.plan.model import plan_to_dict

    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(yaml.safe_dump(plan_to_dict(tiny_plan())))
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(plan_file), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    pids = json.loads(driver.stdout.readline())
    assert pids and all(pid_alive(p) for p in pids)
    driver.send_signal(signal.SIGINT)
    driver.wait(timeout=60)
    assert wait_gone(pids) == []


def test_the_tiny_model_is_built_in_the_cache_the_plan_was_compiled_with(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "planned"))
    plan = tiny_plan("model.path=tiny:tiny-moe")
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "now"))  # e.g. a resume from another shell
    LocalExecutor(plan, tmp_path / "run").prepare_model()
    assert Path(plan.model_path).parent == tmp_path / "planned" / "models"
    assert (Path(plan.model_path) / "config.json").is_file()
    assert not (tmp_path / "now").exists()
