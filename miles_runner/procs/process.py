"""Supervised child processes: each in its own process group, health-checked, and stopped as a whole group.

Every process started here is also stopped at interpreter exit (atexit), so a crashed driver or a failed test
leaves nothing behind; and each child asks the kernel to kill it when its parent dies (PR_SET_PDEATHSIG), which
covers a parent killed with SIGKILL too (the child's own children are its concern).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from miles_runner.core.errors import ComponentFailure
from miles_runner.plan.secrets import fill_secrets
from miles_runner.procs.listeners import PortOwners, listener_owners
from miles_runner.procs.warm import WARM_START_ENV, WarmChild, server_argv, wait_ready, warm_start

LOG_TAIL_LINES = 40
# Health polls are frequent for the first seconds, then every _POLL_S: a forked (warm) server is healthy within a
# fraction of a second, which polls every _POLL_S would notice up to a whole interval late, and a refused connection
# costs next to nothing.
_FAST_POLL_S, _FAST_POLL_FOR_S = 0.05, 2.0
_POLL_S = 0.2
_TAIL_BYTES = 64 * 1024
_PROC = Path("/proc")
# What a server that could not bind its port prints (Python's OSError, uvicorn, SGLang, the Rust router alike).
_BIND_FAILED = "address already in use"
_running: set[ManagedProcess] = set()
log = logging.getLogger(__name__)


class ProcessStartError(ComponentFailure):
    """A supervised process exited early or never became healthy; the message has exit code and log tail."""

    def __str__(self) -> str:
        header = f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---"
        return f"{self.component} {self.reason}\n{header}\n{self.log_tail}"


class ManagedProcess:
    """One child process, started in a new session (so it leads its own process group) with output in a log.

    `env` adds to (or overrides) the parent's environment. `health_url` is polled with GET until it answers
    200 from a socket that the process or a descendant listens on (each probe waits at most `health_timeout_s`, all
    probes together at most `startup_timeout_s`).
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        log_path: str | Path,
        health_url: str | None = None,
        startup_timeout_s: float = 120.0,
        health_timeout_s: float = 5.0,
    ) -> None:
        self.name = name
        self.argv = [str(arg) for arg in argv]
        self.env = dict(env or {})
        self.cwd = cwd
        self.log_path = Path(log_path).absolute()  # a warm start's server opens it from its own folder
        self.health_url = health_url
        self.startup_timeout_s = startup_timeout_s
        self.health_timeout_s = health_timeout_s
        self._popen: subprocess.Popen[bytes] | WarmChild | None = None

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name!r}, pid={self.pid}, alive={self.alive})"

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    @property
    def alive(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll() if self._popen else None

    def start(self) -> ManagedProcess:
        if self._popen is not None:
            raise RuntimeError(f"{self.name} was already started (pid {self.pid})")
        env = {**os.environ, **self.env}
        argv = fill_secrets(self.argv, env)  # the run's key reaches only the child's argv, never the log line
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            log.write(f"# {self.name}: {shlex.join(self.argv)}\n".encode())
            log.flush()
            # Forked by the warm start server when the environment names one and it can (procs/warm.py).
            self._popen = warm_start(argv, env, self.cwd, self.log_path) or subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        _running.add(self)
        return self

    def wait_healthy(self) -> None:
        """Block until `health_url` answers 200 from this process's own server: every socket listening there is
        held by it or its descendants (procs/listeners.py), since a port checked free can still be taken by another
        run's server before ours binds it. On early exit, timeout or a port held by another process, stop the
        group and raise; nothing but health probes was sent to the port."""
        if self._popen is None:
            raise RuntimeError(f"{self.name} was never started")
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        answered = False  # by its health URL, but from no socket of its own
        with httpx.Client(timeout=self.health_timeout_s, trust_env=False) as http:
            while True:
                if not self.alive:
                    raise self.start_failed("exited before it was healthy" + self._port_taken_note())
                if self.health_url is None:
                    return
                if _answers_ok(http, self.health_url):
                    if self._owns_port():
                        return
                    answered = True
                if time.monotonic() >= deadline:
                    raise self.start_failed(self._not_healthy_reason(answered))
                time.sleep(_FAST_POLL_S if time.monotonic() - started < _FAST_POLL_FOR_S else _POLL_S)

    def health_address(self) -> tuple[str, int] | None:
        """The host and port its health URL connects to (None without one)."""
        if self.health_url is None:
            return None
        url = urlsplit(self.health_url)
        return url.hostname or "", url.port or (443 if url.scheme == "https" else 80)

    def port_owners(self) -> PortOwners | None:
        """Who holds the sockets listening at its health address, seen from this process's tree (None: no health
        URL, not started, or a host whose /proc cannot tell)."""
        address = self.health_address()
        if address is None or self.pid is None:
            return None
        return listener_owners(*address, self.pid)

    def _owns_port(self) -> bool:
        """After a health answer: whether it came from this process's server. Raises the start failure if another
        process listens there; False while nothing listens (it closed since), to poll again."""
        owners = self.port_owners()
        if owners is None:
            _warn_unproven()
            return True
        if owners.others:
            host, port = self.health_address() or ("", 0)
            raise self.start_failed(
                f"lost its port {host}:{port} to {'; '.join(owners.others)}, which answered its health check "
                "(nothing else was sent there; stop that process or give this run other ports), and was stopped"
            )
        return owners.ours > 0

    def _not_healthy_reason(self, answered: bool) -> str:
        within = f"within {self.startup_timeout_s:g} s"
        if answered:
            own = f"pid {self.pid} or a child"
            return f"answered at {self.health_url}, but never from a socket of its own ({own}) {within}"
        return f"was not healthy at {self.health_url} {within}" + self._port_taken_note()

    def _port_taken_note(self) -> str:
        """Why it never served, where its port is the reason: who holds it now, or the bind failure in its log."""
        address = self.health_address()
        if address is None:
            return ""
        host, port = address
        if (owners := self.port_owners()) is not None and owners.others:
            return f": its port {host}:{port} is held by {'; '.join(owners.others)}"
        if _BIND_FAILED in self.log_tail().lower():
            return f": its port {host}:{port} was in use ({_BIND_FAILED}), by a process that has let it go since"
        return ""

    def terminate(self) -> None:
        """SIGTERM the process group of a running process without waiting (stop() then waits for it)."""
        if self._popen is not None and self.alive:  # not reaped yet, so its pid (the group's id) cannot be reused
            _signal_group(self._popen.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM the whole process group, SIGKILL what is left after `timeout_s`; returns the exit code."""
        if self._popen is None:
            return None
        _running.discard(self)
        group = self._popen.pid  # the child leads its own group (start_new_session)
        deadline = time.monotonic() + timeout_s
        _signal_group(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(max(deadline - time.monotonic(), 0))
        # Grandchildren may outlive the leader; they get the rest of the grace period, then SIGKILL.
        if not _wait_group_gone(group, deadline):
            _signal_group(group, signal.SIGKILL)
        return self._popen.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(log.seek(0, os.SEEK_END) - _TAIL_BYTES, 0))
                text = log.read().decode(errors="replace")
        except FileNotFoundError:
            return "(no log file)"
        return "\n".join(text.splitlines()[-lines:])

    def start_failed(self, reason: str) -> ProcessStartError:
        """Stop the process (group) and return the error to raise: reason, exit code and log tail."""
        code = self.stop()
        return ProcessStartError(
            self.name, f"{reason} (exit code {code})", log_path=str(self.log_path), log_tail=self.log_tail()
        )

    def died(self) -> ComponentFailure | None:
        """The failure to report if this process has exited (it never should while its run goes on)."""
        if self.alive:
            return None
        return ComponentFailure(
            self.name,
            f"exited with code {self.returncode} while the run was going on",
            log_path=str(self.log_path),
            log_tail=self.log_tail(),
        )

    def __enter__(self) -> ManagedProcess:
        self.start()
        self.wait_healthy()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def start_warm_server(socket_path: Path, log_path: Path, *options: str) -> ManagedProcess:
    """The warm start server (procs/warm.py; `options`: its --preload, --modules) on `socket_path`, ready; put
    `MILES_WARM_START=<socket_path>` in the environment of the processes it should start. Stop it as any
    ManagedProcess."""
    argv = server_argv(socket_path, *options)
    server = ManagedProcess("warm-start", argv, env={WARM_START_ENV: ""}, log_path=log_path)
    server.start()
    try:
        wait_ready(socket_path, alive=lambda: server.alive)
    except RuntimeError as error:
        raise server.start_failed(str(error)) from error
    return server


class ProcessGroup:
    """Processes started in order, each healthy before the next, and stopped in reverse order.

    If one fails to start, the ones already running are stopped before the error propagates.
    """

    def __init__(self) -> None:
        self._processes: list[ManagedProcess] = []

    @property
    def processes(self) -> tuple[ManagedProcess, ...]:
        return tuple(self._processes)

    def start(self, *processes: ManagedProcess) -> None:
        for process in processes:
            try:
                process.start()
                process.wait_healthy()
            except BaseException:
                process.stop()
                self.stop()
                raise
            self._processes.append(process)

    def replace(self, old: ManagedProcess, new: ManagedProcess) -> ManagedProcess:
        """Start `new` (healthy, or it raises) in `old`'s place in the stop order; `old` must be stopped."""
        position = self._processes.index(old)
        try:
            new.start()
            new.wait_healthy()
        except BaseException:
            new.stop()
            raise
        self._processes[position] = new
        return new

    def adopt(self, process: ManagedProcess) -> ManagedProcess:
        """Take over a process that is already running and healthy (e.g. from `start_engine`)."""
        self._processes.append(process)
        return process

    def stop(self, timeout_s: float = 10.0) -> None:
        while self._processes:
            self._processes.pop().stop(timeout_s)

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In the child, before exec: the kernel SIGKILLs it when the process that started it dies, even by
    SIGKILL, so a killed driver never leaves servers holding its ports (Linux; elsewhere a no-op)."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1


@functools.cache  # once per process: the same for every server on this host
def _warn_unproven() -> None:
    log.warning(
        "this host's /proc/net/tcp cannot be read, so a server that answers its health check is not proven to be the "
        "one started (another process on its port would be used); ports are only checked free before the start"
    )


def _answers_ok(http: httpx.Client, url: str) -> bool:
    try:
        return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def _signal_group(group: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return _has_live_member(group)


def _has_live_member(group: int) -> bool:
    """killpg(0) also counts zombies, which a container's init may reap only seconds later; /proc does not."""
    if not _PROC.is_dir():
        return True
    for stat in _PROC.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError):
            continue
        if int(pgrp) == group and state != "Z":
            return True
    return False


def _wait_group_gone(group: int, deadline: float) -> bool:
    while _group_exists(group):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def running_processes() -> list[ManagedProcess]:
    """The processes started here and not stopped yet."""
    return list(_running)


def terminate_running() -> None:
    """SIGTERM every running process at once, so that their shutdowns overlap: stopped one after another, each
    waited for the last to finish its own (about half a second for a server)."""
    for process in running_processes():
        process.terminate()


@atexit.register
def _stop_all_running() -> None:
    terminate_running()
    for process in running_processes():
        process.stop(timeout_s=5.0)
