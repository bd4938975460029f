"""Starting engines from a rendered argv: URL and port checks, and a failed start with its log tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ProcessStartError
from miles_testkit.launch import argv_flag, engine_url, start_engine

from .engines import TEST_ENV, plain_engine_argv

pytestmark = pytest.mark.integration


def test_argv_flag_reads_both_spellings_and_the_last_wins() -> None:
    argv = ["python", "-m", "sglang.launch_server", "--port", "1", "--host=10.0.0.2", "--port=2"]
    assert argv_flag(argv, "--port") == "2" and argv_flag(argv, "--host") == "10.0.0.2"
    assert argv_flag(argv, "--tp-size") is None


def test_engine_bound_to_all_addresses_is_reached_on_loopback() -> None:
    assert engine_url(["--host", "0.0.0.0"], 30000) == "http://127.0.0.1:30000"
    assert engine_url(["--host", "10.0.0.2"], 30000) == "http://10.0.0.2:30000"
    assert engine_url([], 30000) == "http://127.0.0.1:30000"


def test_start_engine_refuses_a_port_that_is_not_in_the_argv(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--port 1"):
        start_engine(["python", "--port", "1"], port=2, log_path=tmp_path / "engine.log")


def test_engine_that_cannot_start_reports_exit_code_and_log_tail(tmp_path: Path) -> None:
    port = free_port()
    argv = plain_engine_argv(tmp_path / "no-such-model", port)
    with pytest.raises(ProcessStartError) as failure:
        start_engine(argv, port=port, log_path=tmp_path / "engine.log", env=TEST_ENV, timeout_s=120)
    message = str(failure.value)
    assert f"engine:{port} exited before it was healthy (exit code" in message
    assert "no-such-model" in message
