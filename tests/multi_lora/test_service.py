"""The controller as its own service: settings from a saved plan or from flags, and the module's command line."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from miles_runner.config.compose import compose
from miles_runner.multi_lora.controller import ABORT_TIMEOUT_S
from miles_runner.multi_lora.http_server import GRACEFUL_SHUTDOWN_S
from miles_runner.multi_lora.settings import TOKEN_ENV, load_settings, parse_args
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import plan_to_dict
from miles_runner.plan.record import write_ports
from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess, ProcessStartError

pytestmark = pytest.mark.integration

MODULE = "miles_runner.multi_lora.http_server"


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder holding the saved plan of the tiny multi-LoRA recipe, and the ports its engine was started on
    (the executor records them before the controller starts)."""
    folder = tmp_path_factory.mktemp("run")
    plan = compile_plan(compose(["+recipe=tiny_multi_lora"]))
    (folder / "plan.yaml").write_text(yaml.safe_dump(plan_to_dict(plan), sort_keys=False))
    write_ports(folder, {"engine0": 30010})
    return folder


def test_plan_settings_take_the_engines_lora_flags_and_the_plan_sizes(plan_dir):
    settings = load_settings(parse_args(["--plan", str(plan_dir / "plan.yaml")]))
    limits = settings.limits
    assert (limits.max_slots, limits.max_lora_rank, limits.dp_size) == (4, 8, 1)
    assert limits.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert settings.engine_urls == ("http://127.0.0.1:30010",)


def test_a_plan_controller_starts_with_the_plans_adapters_registered(plan_dir):
    controller = load_settings(parse_args(["--plan", str(plan_dir / "plan.yaml")])).build_controller()
    pending = controller.snapshot().pending
    assert [(name, run.slot) for name, run in pending.items()] == [("count", 0), ("retry", 1), ("letters", 2)]
    assert pending["retry"].config.save == str(plan_dir / "adapters" / "retry")


def test_without_a_plan_the_engine_limits_are_required():
    with pytest.raises(SystemExit):
        parse_args(["--max-slots", "2"])


def start_service(argv: list[str], log_dir: Path, **options) -> tuple[ManagedProcess, str]:
    port = free_port()
    argv = [sys.executable, "-m", MODULE, *argv, "--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    process = ManagedProcess(
        "controller",
        argv,
        log_path=log_dir / "controller.log",
        health_url=f"{url}/health",
        startup_timeout_s=60,
        **options,
    )
    return process, url


def test_the_module_serves_a_saved_plan_from_its_run_folder(plan_dir):
    process, url = start_service(["--plan", "plan.yaml"], plan_dir, cwd=plan_dir)
    with process:
        adapters = httpx.get(f"{url}/adapter_runs", trust_env=False).json()["adapters"]
    assert [a["name"] for a in adapters] == ["count", "retry", "letters"]


def test_the_standalone_module_requires_its_token(tmp_path):
    flags = ["--max-slots", "1", "--max-lora-rank", "8", "--target-modules", "q_proj", "v_proj"]
    process, url = start_service(flags, tmp_path, env={TOKEN_ENV: "tok"})
    body = {"name": "a", "config": {"rank": 4}}
    with process, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.post("/adapter_runs", json=body).status_code == 401
        registered = http.post("/adapter_runs", json=body, headers={"Authorization": "Bearer tok"})
    assert registered.json() == {"name": "a", "slot": 0}


@pytest.mark.reliability
def test_the_module_requires_the_key_of_the_variable_api_key_env_names_and_keeps_it_out_of_argv(tmp_path):
    flags = ["--max-slots", "1", "--max-lora-rank", "8", "--target-modules", "q_proj", "--api-key-env", "RUN_KEY"]
    process, url = start_service(flags, tmp_path, env={"RUN_KEY": "k3y-value"})
    with process, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.get("/adapter_runs").status_code == 401
        assert http.get("/adapter_runs", headers={"Authorization": "Bearer k3y-value"}).status_code == 200
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
    assert b"k3y-value" not in cmdline and b"RUN_KEY" in cmdline


@pytest.mark.reliability
def test_a_named_key_variable_that_is_unset_stops_the_module_naming_it(tmp_path):
    flags = ["--max-slots", "1", "--max-lora-rank", "8", "--target-modules", "q_proj", "--api-key-env", "NO_SUCH_KEY"]
    process, _ = start_service(flags, tmp_path, env={"NO_SUCH_KEY": ""})
    with pytest.raises(ProcessStartError, match="exited before it was healthy") as failed, process:
        pass
    assert "$NO_SUCH_KEY is unset or empty" in failed.value.log_tail


@contextlib.contextmanager
def silent_engine() -> Iterator[tuple[str, threading.Event]]:
    """A loopback port that takes connections and never answers (an engine stuck mid-request); the event is set
    once a request arrived."""
    arrived = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as server:
        held: list[socket.socket] = []

        def accept() -> None:
            with contextlib.suppress(OSError):
                connection, _ = server.accept()
                held.append(connection)
                connection.recv(65536)
                arrived.set()

        threading.Thread(target=accept, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.getsockname()[1]}", arrived
        finally:
            for connection in held:
                connection.close()


@pytest.mark.reliability
def test_sigterm_ends_the_service_while_an_abort_waits_on_a_silent_engine(tmp_path):
    """Without a bound, uvicorn waits for the in-flight abort (ABORT_TIMEOUT_S); SIGTERM must not."""
    with silent_engine() as (engine_url, arrived):
        flags = ["--max-slots", "1", "--max-lora-rank", "8", "--target-modules", "q_proj", "--engine-urls", engine_url]
        process, url = start_service(flags, tmp_path)
        with process, httpx.Client(base_url=url, trust_env=False, timeout=60) as http:
            assert http.post("/adapter_runs", json={"name": "a", "config": {}}).status_code == 200
            assert http.delete("/adapter_runs/a").status_code == 200

            def retire() -> None:  # its answer never comes: the service ends under it
                with contextlib.suppress(httpx.HTTPError):
                    http.post("/control/retire_adapters")

            threading.Thread(target=retire, daemon=True).start()
            assert arrived.wait(30), "the abort never reached the engine"
            os.kill(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + ABORT_TIMEOUT_S * 2 / 3  # GRACEFUL_SHUTDOWN_S is well inside it
            while process.alive and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not process.alive, f"still running {ABORT_TIMEOUT_S * 2 / 3:g} s after SIGTERM"
    assert GRACEFUL_SHUTDOWN_S < ABORT_TIMEOUT_S * 2 / 3
