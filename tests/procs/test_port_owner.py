"""A server counts as healthy only once it is proven to be the one started: the socket listening where its health URL
connects is held by the process started or by one of its descendants. Another process there (another run's server)
fails the start, naming the port and the holder, and gets nothing but health probes."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from miles_runner.procs import listeners, process
from miles_runner.procs.listeners import PortOwners
from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess, ProcessStartError
from miles_runner.procs.warm import WARM_START_ENV, WARM_START_OFF

pytestmark = pytest.mark.integration


def port_server(port: int, *options: str) -> list[str]:
    return [sys.executable, "-m", "tests.procs.port_server", str(port), *options]


def managed(tmp_path: Path, argv: list[str], port: int, health_timeout_s: float = 5.0) -> ManagedProcess:
    url = f"http://127.0.0.1:{port}/health"
    return ManagedProcess(
        "server", argv, log_path=tmp_path / "server.log", health_url=url, health_timeout_s=health_timeout_s
    )


@contextmanager
def foreign_server(tmp_path: Path, port: int) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A server on `port` that no ManagedProcess started (another run's), recording each request it gets."""
    requests = tmp_path / "foreign-requests.txt"
    server = subprocess.Popen(port_server(port, "--requests", str(requests)), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and "serving" in server.stdout.readline()
        yield server, requests
    finally:
        server.kill()
        server.wait()


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_server_whose_port_another_socket_holds_fails_naming_the_port_and_the_holder(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", port))
        blocker.listen()
        server = managed(tmp_path, port_server(port), port, health_timeout_s=0.5)
        server.start()
        with pytest.raises(ProcessStartError) as failure:
            server.wait_healthy()
    message = str(failure.value)
    assert f"exited before it was healthy: its port 127.0.0.1:{port} is held by pid {os.getpid()} (" in message
    assert "(exit code 3)" in message and not server.alive


def test_a_foreign_server_answering_the_health_check_fails_the_start_and_gets_only_health_probes(
    tmp_path: Path,
) -> None:
    port = free_port()
    with foreign_server(tmp_path, port) as (foreign, requests):
        # Ours binds late (a model loading), so the other server answers its probes meanwhile.
        server = managed(tmp_path, port_server(port, "--bind-after", "60"), port)
        server.start()
        with pytest.raises(ProcessStartError) as failure:
            server.wait_healthy()
        assert foreign.poll() is None
    message = str(failure.value)
    assert f"lost its port 127.0.0.1:{port} to pid {foreign.pid} (" in message
    assert "tests.procs.port_server" in message and "nothing else was sent there" in message
    assert set(requests.read_text().splitlines()) == {"GET /health"}
    assert not server.alive


def test_a_server_that_binds_in_a_child_process_is_healthy(tmp_path: Path) -> None:
    port = free_port()
    with managed(tmp_path, port_server(port, "--in-child"), port) as server:
        assert server.port_owners() == PortOwners(ours=1, others=())
        # The listening socket's holder: any process's outgoing connection may have `port` as its local port too.
        listening = {s.link: s.uid for s in listeners.tcp_sockets() or () if s.port == port and s.listening}
        (holder,) = listeners.describe_holders(listening)
        assert not holder.startswith(f"pid {server.pid} ")  # the child holds it, not the process started


def test_a_warm_started_server_is_healthy(tmp_path: Path) -> None:
    if os.environ.get(WARM_START_ENV) in (None, WARM_START_OFF):
        pytest.skip("no warm start server in this test run")
    port = free_port()
    with managed(tmp_path, port_server(port), port) as server:
        assert server.pid is not None and parent_of(server.pid) != os.getpid()  # the warm start server forked it
        assert server.port_owners() == PortOwners(ours=1, others=())


def test_an_early_exit_whose_log_shows_a_bind_failure_names_the_port(tmp_path: Path) -> None:
    port = free_port()
    crasher = [sys.executable, "-c", "print('OSError: [Errno 98] Address already in use'); raise SystemExit(1)"]
    server = managed(tmp_path, crasher, port)
    server.start()
    with pytest.raises(ProcessStartError, match=rf"its port 127\.0\.0\.1:{port} was in use \(address already in use\)"):
        server.wait_healthy()


def test_where_proc_cannot_tell_the_health_answer_is_trusted_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(listeners, "TCP_TABLES", (tmp_path / "no-such-table",))
    process._warn_unproven.cache_clear()
    port = free_port()
    with caplog.at_level(logging.WARNING), managed(tmp_path, port_server(port), port) as server:
        assert server.port_owners() is None
    assert "/proc/net/tcp cannot be read" in caplog.text
    process._warn_unproven.cache_clear()


def test_a_health_answer_from_no_socket_of_its_own_is_never_healthy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(process, "listener_owners", lambda *_: PortOwners(ours=0, others=()))  # e.g. another netns
    port = free_port()
    server = ManagedProcess(
        "server",
        port_server(port),
        log_path=tmp_path / "server.log",
        health_url=f"http://127.0.0.1:{port}/health",
        startup_timeout_s=1.0,
    )
    server.start()
    with pytest.raises(ProcessStartError, match=r"answered at http://\S+, but never from a socket of its own"):
        server.wait_healthy()
