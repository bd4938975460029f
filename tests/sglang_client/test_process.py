"""Process supervision: health checks with a log tail on failure, whole-group stop, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import LOG_TAIL_LINES, ManagedProcess, ProcessGroup, ProcessStartError

pytestmark = pytest.mark.integration


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def http_server(port: int) -> list[str]:
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]


def pid_alive(pid: int) -> bool:
    """A zombie (exited, not yet reaped by init) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_for_file(path: Path, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.05)
    return path.read_text().strip()


def managed(tmp_path: Path, argv: list[str], **kwargs) -> ManagedProcess:
    return ManagedProcess("probe", argv, log_path=tmp_path / "probe.log", **kwargs)


def test_wait_healthy_returns_once_health_url_answers(tmp_path: Path) -> None:
    port = free_port()
    with managed(tmp_path, http_server(port), health_url=f"http://127.0.0.1:{port}/") as process:
        assert process.alive
    assert not process.alive


def test_health_timeout_reports_log_tail_and_stops_process(tmp_path: Path) -> None:
    printer = python("""
        import time
        for i in range(100):
            print(f"line {i}", flush=True)
        time.sleep(600)
    """)
    url = f"http://127.0.0.1:{free_port()}/health"
    process = managed(tmp_path, printer, health_url=url, startup_timeout_s=1.5)
    process.start()
    with pytest.raises(ProcessStartError) as failure:
        process.wait_healthy()
    message = str(failure.value)
    assert "was not healthy" in message and url in message
    assert "line 99" in message and f"line {99 - LOG_TAIL_LINES}" not in message
    assert not process.alive


def test_early_exit_reports_exit_code_without_waiting_for_timeout(tmp_path: Path) -> None:
    crasher = python("""
        import sys
        print("model folder missing", flush=True)
        sys.exit(3)
    """)
    process = managed(tmp_path, crasher, health_url=f"http://127.0.0.1:{free_port()}/", startup_timeout_s=60)
    started = time.monotonic()
    with pytest.raises(ProcessStartError, match=r"(?s)exited before it was healthy \(exit code 3\).*model folder"):
        process.__enter__()
    assert time.monotonic() - started < 10


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    parent = ["bash", "-c", f"sleep 600 & echo $! > {pid_file}; wait"]
    process = managed(tmp_path, parent).start()
    grandchild = int(wait_for_file(pid_file))
    assert pid_alive(grandchild)
    process.stop(timeout_s=5)
    assert not process.alive and not pid_alive(grandchild)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    stubborn = python(f"""
        import signal, time, pathlib
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        pathlib.Path({str(ready)!r}).write_text("1")
        time.sleep(600)
    """)
    process = managed(tmp_path, stubborn).start()
    wait_for_file(ready)
    started = time.monotonic()
    assert process.stop(timeout_s=0.5) == -9
    assert time.monotonic() - started < 5


def test_process_group_stops_started_processes_when_a_later_one_fails(tmp_path: Path) -> None:
    port = free_port()
    first = ManagedProcess(
        "first", http_server(port), log_path=tmp_path / "first.log", health_url=f"http://127.0.0.1:{port}/"
    )
    failing = ManagedProcess(
        "second",
        python("raise SystemExit(2)"),
        log_path=tmp_path / "second.log",
        health_url=f"http://127.0.0.1:{free_port()}/",
    )
    group = ProcessGroup()
    with pytest.raises(ProcessStartError, match="second"):
        group.start(first, failing)
    assert not first.alive and group.processes == ()


def test_process_group_stops_in_reverse_start_order(tmp_path: Path) -> None:
    stop_log = tmp_path / "stops.log"
    ready = [tmp_path / f"ready{i}" for i in range(2)]

    def recorder(name: str, ready_file: Path) -> list[str]:
        return python(f"""
            import signal, sys, time, pathlib
            def on_term(*_):
                with open({str(stop_log)!r}, "a") as log:
                    log.write({name!r} + "\\n")
                sys.exit(0)
            signal.signal(signal.SIGTERM, on_term)
            pathlib.Path({str(ready_file)!r}).write_text("1")
            time.sleep(600)
        """)

    with ProcessGroup() as group:
        for i, name in enumerate(("engine", "router")):
            group.start(ManagedProcess(name, recorder(name, ready[i]), log_path=tmp_path / f"{name}.log"))
            wait_for_file(ready[i])
    assert stop_log.read_text().split() == ["router", "engine"]


def test_terminate_running_signals_every_running_process_at_once_and_stop_then_waits_for_each(tmp_path: Path) -> None:
    # In a driver process of its own: terminate_running() signals every process this worker runs, shared servers too.
    slow_to_stop = textwrap.dedent("""
        import signal, sys, time
        def on_term(*_):
            with open(sys.argv[1], "a") as log:
                log.write(sys.argv[2] + "\\n")
            time.sleep(1.0)  # exits a while after its SIGTERM
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        print("ready", "to", "stop", flush=True)  # the log's first line (the command) lacks the phrase
        time.sleep(600)
    """)
    driver = python(f"""
        import json, pathlib, sys, time
        from miles_runner.procs.process import ManagedProcess, running_processes, terminate_running
        terms, folder = pathlib.Path({str(tmp_path / "terms.log")!r}), pathlib.Path({str(tmp_path)!r})
        def start(name, argv):
            process = ManagedProcess(name, argv, log_path=folder / f"{{name}}.log").start()
            while argv[0] == sys.executable and "ready to stop" not in (folder / f"{{name}}.log").read_text():
                time.sleep(0.05)
            return process
        slow = [start(name, [sys.executable, "-c", {slow_to_stop!r}, str(terms), name]) for name in ("a", "b")]
        stopped = start("stopped", ["sleep", "600"])
        stopped.stop(timeout_s=5)
        running_before = sorted(p.name for p in running_processes())
        terminate_running()
        while len(terms.read_text().split() if terms.exists() else []) < 2:
            time.sleep(0.05)
        print(json.dumps({{"running_before": running_before, "signalled": sorted(terms.read_text().split()),
                          "alive_after_signal": [p.alive for p in slow],
                          "codes": [p.stop(timeout_s=10) for p in slow],
                          "running_after": [p.name for p in running_processes()]}}))
    """)
    finished = subprocess.run(driver, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == {
        "running_before": ["a", "b"],  # a stopped process is no longer among them
        "signalled": ["a", "b"],  # both before either was waited for
        "alive_after_signal": [True, True],
        "codes": [0, 0],
        "running_after": [],
    }


def test_atexit_stops_processes_the_parent_left_running(tmp_path: Path) -> None:
    driver = python(f"""
        from miles_runner.procs.process import ManagedProcess
        child = ManagedProcess("left", ["sleep", "600"], log_path={str(tmp_path / "left.log")!r}).start()
        print(child.pid, flush=True)
        raise RuntimeError("the driver crashed without stopping its child")
    """)
    finished = subprocess.run(driver, capture_output=True, text=True, timeout=60)
    assert finished.returncode == 1 and "crashed" in finished.stderr
    assert not pid_alive(int(finished.stdout.split()[0]))
