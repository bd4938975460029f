"""Schemathesis against a real session server (with the run's key) over a real embedded engine:
0 server errors and 0 schema violations, every operation of its OpenAPI schema fuzzed with bounded examples.

Two passes: the whole surface as an outsider sees it (random session ids), then every per-session operation
but DELETE on one live session (its id fixed), so the chat, samples and proxy handlers see generated bodies.
"""

from __future__ import annotations

import httpx
import pytest

from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.procs.ports import free_port
from miles_runner.session.app import create_app
from miles_runner.session.config import SessionServerConfig
from miles_testkit.launch import embedded_engine_argv, start_engine
from miles_testkit.openapi_fuzz import assert_clean, fuzz_openapi
from miles_testkit.servers import ThreadedServer

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

KEY = "session-fuzz-key"
MAX_EXAMPLES = 10


@pytest.fixture(scope="module")
def session_server(tmp_path_factory):
    model_dir = ensure_tiny_model("tiny-moe")
    port = free_port()
    argv = embedded_engine_argv(model_dir, port, "--api-key", KEY)
    log = tmp_path_factory.mktemp("session-fuzz") / "engine.log"
    engine = start_engine(argv, port=port, log_path=log, timeout_s=300)
    config = SessionServerConfig(
        engine_url=f"http://127.0.0.1:{port}",
        model_path=str(model_dir),
        api_key=KEY,
        upstream_api_key=KEY,
        upstream_timeout_s=30,
        max_sessions=64,
    )
    server = ThreadedServer(create_app(config)).start()
    yield server
    server.stop()
    engine.stop()


def test_fuzzing_the_session_server_finds_no_server_error_and_no_schema_violation(session_server):
    summary = fuzz_openapi(session_server.url, token=KEY, max_examples=MAX_EXAMPLES)
    print(f"\nsession server, random ids: {summary.counts()}")
    assert_clean(summary, min_requests=100)
    assert 401 not in summary.statuses  # the key was accepted: the requests reached the routes


def test_fuzzing_one_live_session_finds_no_server_error_and_no_schema_violation(session_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    session_id = httpx.post(f"{session_server.url}/sessions", headers=auth).json()["session_id"]
    summary = fuzz_openapi(
        session_server.url,
        token=KEY,
        max_examples=MAX_EXAMPLES,
        parameters={"path.session_id": session_id},
        exclude=("DELETE /sessions/{session_id}",),
    )
    print(f"\nsession server, one live session: {summary.counts()}")
    assert_clean(summary, min_requests=100)
    assert summary.statuses[200] > 0  # the live session answered, not only 404s
