"""Warm starts (miles_runner/procs/warm.py): a child forked by the warm start server sees what a cold start of the
same command sees, reports its end as Popen does, dies with its requester or the server, and whatever the server
cannot match starts cold. The probe module (warm_probe.py) writes what it sees; a server of this module's own
forks it (--modules), with numpy preloaded as the real server preloads torch and the rest."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from miles_runner.procs.process import ManagedProcess, start_warm_server
from miles_runner.procs.warm import WARM_START_ENV, WarmChild

pytestmark = pytest.mark.integration

PROBE = "tests.procs.warm_probe"
SETTER = "tests.procs.warm_env_setter"  # sets MILES_PROBE_IMPORT_SET at import, unless it is set
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server_socket() -> str:
    folder = Path(tempfile.mkdtemp(prefix="warm-"))  # short: a Unix socket's path has at most 107 bytes
    server = start_warm_server(
        folder / "warm.sock", folder / "warm.log", "--preload", "numpy", SETTER, "--modules", PROBE
    )
    yield str(folder / "warm.sock")
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


def probe(tmp_path: Path, name: str, code: str, warm_socket: str, **env: str) -> ManagedProcess:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, "-m", PROBE, str(out), code]
    return ManagedProcess(
        name, argv, env={WARM_START_ENV: warm_socket, **env}, cwd=REPO, log_path=tmp_path / f"{name}.log"
    )


def seen(tmp_path: Path, name: str) -> dict:
    deadline = time.monotonic() + 60
    while not (path := tmp_path / f"{name}.json").exists() or not path.read_text().endswith("}"):
        assert time.monotonic() < deadline, f"{name} wrote nothing"
        time.sleep(0.05)
    return json.loads(path.read_text())


def gone(pid: int, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_warm_child_sees_what_a_cold_start_of_its_command_sees(tmp_path, server_socket):
    cold, warm, warm2 = (
        probe(tmp_path, name, "3", sock)
        for name, sock in [("cold", ""), ("warm", server_socket), ("warm2", server_socket)]
    )
    for process in (cold, warm, warm2):
        process.start()
        assert process._popen.wait(60) == 3
    assert isinstance(warm._popen, WarmChild) and isinstance(warm2._popen, WarmChild)
    assert not isinstance(cold._popen, WarmChild)
    views = {name: seen(tmp_path, name) for name in ("cold", "warm", "warm2")}
    draws = {view.pop("numpy_draw") for view in views.values()}
    assert len(draws) == 3  # numpy is reseeded in each child, as its import seeds a cold process
    # What the server had imported is frozen out of a warm child's garbage collections (a full one wrote to every
    # object's header, copying the pages the fork shares); the child's own objects are collected as in a cold start.
    frozen = {name: view.pop("frozen_objects") for name, view in views.items()}
    assert frozen["cold"] == 0 and frozen["warm"] > 5_000, frozen  # numpy alone brings more than that
    for view in views.values():  # only the variable that told ManagedProcess where to start it differs
        view["env"].pop(WARM_START_ENV)
        view["argv"][1] = view["orig_argv"][3] = view["cmdline"][3] = "OUT"
    assert views["warm"] == views["cold"] == views["warm2"], views
    cold_view = views["cold"]
    assert cold_view["name"] == "__main__" and cold_view["main_has_only_its_own_names"]
    assert cold_view["cmdline"] == cold_view["orig_argv"] == [sys.executable, "-m", PROBE, "OUT", "3"]
    assert cold_view["own_group"] and cold_view["own_session"] and cold_view["stdin_is_devnull"]
    assert cold_view["cwd"] == cold_view["path0"] == str(REPO)
    for name in ("warm", "cold"):  # the header ManagedProcess writes, then the child's own output
        lines = (tmp_path / f"{name}.log").read_text().splitlines()
        assert lines[0].startswith(f"# {name}: ") and lines[1].startswith("probe ")


def test_a_warm_child_ended_by_a_signal_reports_it_as_popen_does(tmp_path, server_socket):
    results = {}
    for name, sock in (("cold", ""), ("warm", server_socket)):
        process = probe(tmp_path, name, "wait", sock).start()
        seen(tmp_path, name)
        assert process.alive and process.returncode is None
        results[name] = process.stop(timeout_s=10)
        assert not process.alive
    assert results == {"cold": -signal.SIGTERM, "warm": -signal.SIGTERM}


def test_a_warm_child_dies_with_the_process_that_started_it(tmp_path, server_socket):
    requester = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.procs.test_warm import probe
        from pathlib import Path
        process = probe(Path({str(tmp_path)!r}), "orphan", "wait", {server_socket!r}).start()
        print(type(process._popen).__name__, process.pid, flush=True)
        time.sleep(600)
    """)
    started = subprocess.Popen(
        [sys.executable, "-c", requester], stdout=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ)
    )
    kind, pid = started.stdout.readline().split()
    assert kind == "WarmChild"
    seen(tmp_path, "orphan")
    started.kill()
    started.wait()
    assert gone(int(pid)), "the warm child outlived the process that started it"


def test_a_warm_child_dies_with_the_server_and_reports_it_killed(tmp_path):
    folder = Path(tempfile.mkdtemp(prefix="warm-"))
    server = start_warm_server(folder / "w.sock", folder / "w.log", "--preload", "--modules", PROBE)
    try:
        process = probe(tmp_path, "child", "wait", str(folder / "w.sock")).start()
        seen(tmp_path, "child")
        os.kill(server.pid, signal.SIGKILL)
        assert process._popen.wait(10) == -signal.SIGKILL
        assert gone(process.pid)
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_variable_no_import_read_may_differ_and_the_child_sees_it(tmp_path, server_socket):
    process = probe(tmp_path, "runtime", "0", server_socket, MILES_PROBE_SETTING="on").start()
    assert isinstance(process._popen, WarmChild) and process._popen.wait(60) == 0
    assert seen(tmp_path, "runtime")["env"]["MILES_PROBE_SETTING"] == "on"


def test_what_the_servers_imports_set_reaches_the_child_and_may_come_from_a_requester_that_imported_them(
    tmp_path, server_socket
):
    for name, given in (("unset", None), ("same", "computed-at-import"), ("other", "given")):
        process = probe(
            tmp_path, name, "0", server_socket, **({"MILES_PROBE_IMPORT_SET": given} if given else {})
        ).start()
        assert process._popen.wait(60) == 0
        assert isinstance(process._popen, WarmChild) == (name != "other")  # another value: its import would differ
        assert seen(tmp_path, name)["env"]["MILES_PROBE_IMPORT_SET"] == (given or "computed-at-import")


def test_what_the_server_cannot_match_starts_cold(tmp_path, server_socket):
    cases = {
        # numpy's import reads NUMPY_MADVISE_HUGEPAGE; OMP_* is read by native code at load
        "env": probe(tmp_path, "env", "0", server_socket, NUMPY_MADVISE_HUGEPAGE="0"),
        "native": probe(tmp_path, "native", "0", server_socket, OMP_THREAD_LIMIT="1"),
        "module": ManagedProcess(
            "module",
            [sys.executable, "-m", "json.tool", "--help"],
            log_path=tmp_path / "m.log",
            env={WARM_START_ENV: server_socket},
        ),
        "missing cwd": ManagedProcess(
            "cwd",
            [sys.executable, "-m", PROBE, "x", "0"],
            cwd=tmp_path / "nowhere",
            log_path=tmp_path / "c.log",
            env={WARM_START_ENV: server_socket},
        ),
    }
    off = probe(tmp_path, "off", "0", "off").start()  # MILES_WARM_START=off: no server is asked
    assert not isinstance(off._popen, WarmChild) and off._popen.wait(60) == 0
    for name, variable in (("env", "NUMPY_MADVISE_HUGEPAGE"), ("native", "OMP_THREAD_LIMIT")):
        cases[name].start()
        assert not isinstance(cases[name]._popen, WarmChild) and cases[name]._popen.wait(60) == 0
        assert variable in seen(tmp_path, name)["env"]
    cases["module"].start()
    assert not isinstance(cases["module"]._popen, WarmChild) and cases["module"]._popen.wait(60) == 0
    with pytest.raises(FileNotFoundError):  # as Popen raises it, not a child that fails later
        cases["missing cwd"].start()


def test_a_malformed_request_is_answered_and_the_server_serves_on(tmp_path, server_socket):
    assert oct(os.stat(server_socket).st_mode & 0o777) == oct(0o600)
    good = {"argv": [sys.executable, "-m", PROBE], "env": {}, "cwd": str(REPO), "log_path": "/dev/null"}
    malformed = [b"not json\n", b'{"argv": 3}\n', b"[]\n", b"\xff\n"] + [
        json.dumps({**good, field: value}).encode() + b"\n"
        for field, value in (
            ("env", "x"),
            ("env", {"A": 1}),
            ("argv", []),
            ("argv", [1]),
            ("cwd", None),
            ("log_path", 3),
        )
    ]
    for garbage in malformed:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server_socket)
            conn.sendall(garbage)
            reply = json.loads(conn.makefile("rb").readline())
        assert "malformed request" in reply["cold"], (garbage, reply)
    process = probe(tmp_path, "after", "0", server_socket).start()
    assert isinstance(process._popen, WarmChild) and process._popen.wait(60) == 0


def through_warm_exec(tmp_path: Path, name: str, code: str, warm_socket: str) -> subprocess.Popen:
    """The probe's command behind `python -m miles_runner.procs.warm_exec`, with pipes, as a test starts a run."""
    command = [
        sys.executable,
        "-m",
        "miles_runner.procs.warm_exec",
        sys.executable,
        "-m",
        PROBE,
        str(tmp_path / f"{name}.json"),
        code,
    ]
    return subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, WARM_START_ENV: warm_socket},
    )


def test_warm_exec_runs_the_command_warm_with_its_own_pipes_and_exit_code(tmp_path, server_socket):
    started = through_warm_exec(tmp_path, "piped", "5", server_socket)
    out, err = started.communicate(timeout=60)
    assert started.returncode == 5 and err == ""
    [line] = out.splitlines()  # the child's stdout is the caller's pipe
    assert line.startswith("probe ") and int(line.split()[1]) != started.pid  # forked by the server, not exec'd
    view = seen(tmp_path, "piped")
    assert view["cmdline"][1:3] == ["-m", PROBE] and not view["stdin_is_devnull"]  # the caller's stdin too


def test_warm_exec_passes_signals_on_and_ends_as_its_command_does(tmp_path, server_socket):
    started = through_warm_exec(tmp_path, "signalled", "wait", server_socket)
    seen(tmp_path, "signalled")
    child = int(started.stdout.readline().split()[1])
    started.send_signal(signal.SIGTERM)
    assert started.wait(30) == -signal.SIGTERM
    assert gone(child)


def test_warm_exec_killed_takes_its_command_with_it(tmp_path, server_socket):
    started = through_warm_exec(tmp_path, "orphaned", "wait", server_socket)
    seen(tmp_path, "orphaned")
    child = int(started.stdout.readline().split()[1])
    started.kill()
    started.wait(30)
    assert gone(child), "the command outlived warm_exec"


def test_warm_exec_without_a_server_becomes_its_command(tmp_path):
    started = through_warm_exec(tmp_path, "exec", "4", "off")
    out, _ = started.communicate(timeout=60)
    assert started.returncode == 4 and int(out.split()[1]) == started.pid  # the same process: exec'd cold


def test_a_request_without_its_log_path_must_bring_three_descriptors(server_socket):
    request = {"argv": [sys.executable, "-m", PROBE, "/dev/null", "0"], "env": {}, "cwd": str(REPO), "log_path": None}
    for fds in ([], [0]):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(server_socket)
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
            reply = json.loads(conn.makefile("rb").readline())
        assert "malformed request" in reply["cold"] and f"{len(fds)} descriptors" in reply["cold"], reply
