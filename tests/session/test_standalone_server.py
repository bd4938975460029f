"""The standalone entry point: `python -m miles_runner.session.server ...` as its own process."""

import sys

import httpx
import pytest

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_runner.session.server import build_parser, config_from_args

pytestmark = pytest.mark.integration


def test_cli_flags_map_onto_the_config():
    args = build_parser().parse_args(
        [
            "--engine-url",
            "http://127.0.0.1:1",
            "--model-path",
            "m",
            "--port",
            "7",
            "--version",
            "v2",
            "--lora-name",
            "miles_lora",
            "--addition-r3",
            "--api-key",
            "k",
        ]
    )
    config = config_from_args(args)
    assert (config.version, config.lora_name, config.upstream_api_key) == ("v2", "miles_lora", "k")
    assert config.use_addition_r3 and config.return_routed_experts
    assert config.host == "127.0.0.1"


@pytest.fixture()
def standalone_server(engine_url, tiny_model_dir, tmp_path):
    port = free_port()
    argv = [sys.executable, "-m", "miles_runner.session.server", "--engine-url", engine_url]
    argv += ["--model-path", str(tiny_model_dir), "--port", str(port), "--lora-name", "miles_lora"]
    url = f"http://127.0.0.1:{port}"
    process = ManagedProcess(
        "session-server", argv, log_path=tmp_path / "session.log", health_url=f"{url}/health", startup_timeout_s=120
    )
    with process:
        yield url


def test_the_standalone_server_serves_a_turn(standalone_server):
    session_id = httpx.post(f"{standalone_server}/sessions").json()["session_id"]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    reply = httpx.post(f"{standalone_server}/sessions/{session_id}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200
    [record] = httpx.get(f"{standalone_server}/sessions/{session_id}").json()["records"]
    assert record["request"]["lora_path"] == "miles_lora"


def test_the_plans_session_limits_and_key_reach_the_server(monkeypatch):
    from miles_runner.config.compose import compose
    from miles_runner.plan.compile import compile_plan

    overrides = [
        "+recipe=tiny_lora_agentic",
        "session.max_sessions=177",
        "session.max_age_s=12.5",
        "session.port=30001",
    ]
    plan = compile_plan(compose([*overrides, "security.api_key_env=SESSION_TEST_KEY"]))
    monkeypatch.setenv("SESSION_TEST_KEY", "k-123")
    config = config_from_args(build_parser().parse_args(plan.session.launch.argv[3:]))
    assert (config.max_sessions, config.max_age_s) == (177, 12.5)
    assert config.api_key == config.upstream_api_key == "k-123"


def test_api_key_env_naming_an_unset_variable_stops_the_server(monkeypatch):
    monkeypatch.delenv("SESSION_TEST_KEY", raising=False)
    args = build_parser().parse_args(
        ["--engine-url", "http://127.0.0.1:1", "--model-path", "m", "--port", "7", "--api-key-env", "SESSION_TEST_KEY"]
    )
    with pytest.raises(SystemExit, match="SESSION_TEST_KEY, which is unset or empty"):
        config_from_args(args)
