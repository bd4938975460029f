"""SIGTERM ends the standalone session server within a bounded time: in-flight turns are aborted
on their engine, and a turn stuck on a hung engine cannot hold the server for the 600 s upstream timeout."""

import signal
import sys
import threading
import time

import httpx
import pytest
from servers import FaultInjectingUpstream

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_testkit.servers import RecordingProxy

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

STOP_LIMIT_S = 30  # far below the 600 s upstream timeout; past it ManagedProcess.stop sends SIGKILL
LONG_TURN = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 1500,
    "temperature": 0,
    "ignore_eos": True,
}


def start_server(upstream_url: str, model_dir, log_path) -> tuple[ManagedProcess, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "miles_runner.session.server",
        "--engine-url",
        upstream_url,
        "--model-path",
        str(model_dir),
        "--port",
        str(port),
        "--upstream-timeout",
        "600",
        "--log-level",
        "info",
    ]
    process = ManagedProcess(
        "session-server", argv, log_path=log_path, health_url=f"{url}/health", startup_timeout_s=120
    )
    process.start()
    process.wait_healthy()
    return process, url


def turn_in_background(url: str) -> tuple[threading.Thread, list]:
    """POST one long turn from a thread; the list gets its response or the exception it ended with."""
    outcome: list = []

    def play() -> None:
        session_id = httpx.post(f"{url}/sessions").json()["session_id"]
        try:
            outcome.append(httpx.post(f"{url}/sessions/{session_id}/v1/chat/completions", json=LONG_TURN, timeout=700))
        except httpx.HTTPError as error:
            outcome.append(error)

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread, outcome


def wait_for(predicate) -> None:
    while not predicate():
        time.sleep(0.02)


def test_sigterm_aborts_the_in_flight_turn_on_the_engine_and_exits(engine_url, tiny_model_dir, tmp_path):
    with RecordingProxy(engine_url) as engine:
        process, url = start_server(engine.url, tiny_model_dir, tmp_path / "session.log")
        try:
            thread, outcome = turn_in_background(url)
            wait_for(lambda: "/generate" in engine.paths())
            code = process.stop(STOP_LIMIT_S)
            thread.join(STOP_LIMIT_S)
        finally:
            process.stop()
        [generate] = [r for r in engine.sent if r.path == "/generate"]
        aborts = [r.body for r in engine.sent if r.path == "/abort_request"]
    assert code in (0, -signal.SIGTERM), process.log_tail()  # not SIGKILLed at the limit
    assert {"rid": generate.body["rid"], "abort_all": False} in aborts
    [reply] = outcome
    assert reply.status_code == 503 and "shutting down" in reply.json()["error"]


def test_sigterm_ends_the_server_while_the_engine_hangs(engine_url, tiny_model_dir, tmp_path):
    upstream = FaultInjectingUpstream(engine_url).start()
    upstream.hanging = True  # no reply, not even to the abort
    try:
        process, url = start_server(upstream.url, tiny_model_dir, tmp_path / "session.log")
        try:
            thread, outcome = turn_in_background(url)
            wait_for(lambda: "/generate" in upstream.received)
            code = process.stop(STOP_LIMIT_S)
            thread.join(STOP_LIMIT_S)
        finally:
            process.stop()
    finally:
        upstream.hanging = False
        upstream.stop()
    assert code in (0, -signal.SIGTERM), process.log_tail()
    assert "Application shutdown complete" in process.log_tail()
    assert outcome and not thread.is_alive()  # the agent's request ended (cut off) instead of hanging
