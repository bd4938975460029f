"""Warm starts: the runner's own Python components forked from a server that has imported the heavy libraries.

A cold start of an embedded engine costs seconds of CPU before it serves, nearly all of it imports: torch, and
transformers' MoE modelling, which pulls in torch._dynamo and torch.distributed.tensor. A test suite or a sweep
on one machine starts hundreds of engines, session servers and trainer ranks. With `MILES_WARM_START=<socket>`
in a child's environment, `ManagedProcess` asks the warm server listening there to fork the child instead of
starting a new interpreter. The child runs the same module with the same argv, environment, working folder,
log file, process group and parent-death rule as a cold start, from a copy of a process that has already
imported torch, transformers, peft, fastapi and the rest (`PRELOAD`, third-party only: the runner's own modules
are imported in the child, under the child's environment). Its /proc/<pid>/cmdline, and so `ps`, shows its own
argv (followed by empty arguments: the room the server's command line reserved for it).

What a warm child could not match, it is not given: the server forks only `<its own python> -m
miles_runner.<module>` (`--modules`), and only when the request's environment agrees with the server's on every
variable that was read while it imported: each one its Python imports looked up (recorded as they ran), and
those native code reads at load (`NATIVE_PREFIXES`: PYTHON*, LD_*, OMP_*, TORCH*, ...). Otherwise it answers
"cold", and the process starts as it would without the server.
It forks only while it runs a single Python thread (a fork copies the calling thread alone, and a lock another
thread held would stay locked in the child); native pools started at import (OpenBLAS's) stop themselves at a
fork (pthread_atfork) and restart in the child. /proc/<pid>/environ of a warm child shows the server's environment; its
os.environ is the requested one.

    python -m miles_runner.procs.warm --socket PATH    # serve: until SIGTERM, or its parent's death
    MILES_WARM_START=PATH miles-run ...                # that run's Python components start warm

Protocol (one connection per child, over a Unix socket only its owner may open): the client sends one JSON
line {"argv", "env", "cwd", "log_path"}; the server answers {"pid": N} or {"cold": reason}, and at the child's
end {"returncode": rc} (Popen's convention: -N for signal N). A null log_path means the child's stdin, stdout and
stderr ride with the request (three descriptors, SCM_RIGHTS): `warm_exec` passes its own. A connection closed
before the child ends means its requester died: the server SIGKILLs the child, as PR_SET_PDEATHSIG does to a cold
child. The server's own death kills its children the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import runpy
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

WARM_START_ENV = "MILES_WARM_START"
WARM_START_OFF = "off"  # the variable's value that turns warm starts off (the tests start a server unless told so)
RUNNER_MODULES = ("miles_runner.",)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "safetensors.torch",
    "tokenizers",
    "transformers",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen2.modeling_qwen2",
    "peft",
    "fastapi",
    "starlette.responses",
    "uvicorn",
    "httpx",
    "aiohttp",
    "pydantic",
    "yaml",
    "openai",
    "hydra",
    "omegaconf",  # a run's driver (warm_exec): its agents' client, its config composition
    "matplotlib.pyplot",  # ...and its end-of-run plot (tracking/plots.py), a costly import
)
# Variables read at load by native code (the interpreter, the loader, libgomp, OpenBLAS, torch's C++), which the
# server cannot watch: a request must agree with it on these. What Python code reads at import is recorded.
NATIVE_PREFIXES = (
    "PYTHON",
    "LD_",
    "GLIBC_TUNABLES",
    "MALLOC_",
    "TZ",
    "LANG",
    "LC_",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "GOTO",
    "BLIS_",
    "CUDA_",
    "NCCL_",
    "TORCH",
    "PYTORCH",
)
# Libraries that iterate the environment at import for their own prefix (tqdm's envwrap, fsspec's config).
ITERATED_PREFIXES = ("TQDM_", "FSSPEC_")
# PYTHONBREAKPOINT is read at each breakpoint() call, not at start.
READ_LATER = frozenset({"PYTHONBREAKPOINT"})
# The server's command line ends with this much padding: a child rewrites that memory with its own argv.
ARGV_ROOM = 16384
STDIO_FDS = 3
READY_TIMEOUT_S = 120.0
_PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)


# ---- the client side: ManagedProcess -------------------------------------------------------------------------


class _Lines:
    """JSON lines read from a socket."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""
        self.fds: list[int] = []  # descriptors received with the request (its child's stdio)

    def ready(self, timeout: float | None) -> bool:
        if b"\n" in self.buffer:
            return True
        with selectors.DefaultSelector() as selector:
            selector.register(self.conn, selectors.EVENT_READ)
            return bool(selector.select(timeout))

    def read(self) -> dict | None:
        """The next line's object; None at the end of the stream."""
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


class WarmChild:
    """A child the warm server forked for us, with the part of subprocess.Popen that ManagedProcess uses."""

    def __init__(self, lines: _Lines, pid: int, argv: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(argv)
        self.returncode: int | None = None
        self._lines = lines

    def poll(self) -> int | None:
        if self.returncode is None and self._lines.ready(0.0):
            self._read_end()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not self._lines.ready(timeout):
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_end()
        assert self.returncode is not None
        return self.returncode

    def _read_end(self) -> None:
        end = self._lines.read()
        # No reply: the server died, and its children with it (PR_SET_PDEATHSIG).
        self.returncode = int(end["returncode"]) if end else -signal.SIGKILL
        self._lines.conn.close()


def warm_start(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | Path | None,
    log_path: Path | None,
    stdio: Sequence[int] = (),
) -> WarmChild | None:
    """The child forked by the warm server that `env` names, or None (then it starts cold, as usual): no
    server named, not a runner module, or the server's answer was that this one must start cold (logged). Its
    output goes to `log_path`, or with `log_path` None to `stdio` (the descriptors of its stdin, stdout, stderr)."""
    address = env.get(WARM_START_ENV)
    if not address or address == WARM_START_OFF or python_module(argv) is None:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lines = _Lines(conn)
    # A cold child with no cwd of its own inherits ours; the server's is another.
    request = {
        "argv": list(argv),
        "env": dict(env),
        "cwd": str(cwd or os.getcwd()),
        "log_path": None if log_path is None else str(log_path),
    }
    data = json.dumps(request).encode() + b"\n"
    try:
        conn.connect(address)
        sent = socket.send_fds(conn, [data], list(stdio)) if stdio else 0  # the descriptors ride with the start
        conn.sendall(data[sent:])
        reply = lines.read() or {"cold": "the server closed the connection"}
    except OSError as error:
        reply = {"cold": f"the warm start server at {address} is unreachable ({error})"}
    if "pid" not in reply:
        conn.close()
        log.info("%s starts cold: %s", argv[2], reply["cold"])
        return None
    return WarmChild(lines, int(reply["pid"]), argv)


def python_module(argv: Sequence[str]) -> str | None:
    """The module of `<this python> -m <module> ...`; None for any other command."""
    return argv[2] if len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m" else None


def server_argv(socket_path: str | Path, *options: str) -> list[str]:
    """The server's command line (`options`: --preload, --modules); the room for the children's argv last."""
    return [
        sys.executable,
        "-m",
        "miles_runner.procs.warm",
        "--socket",
        str(socket_path),
        *options,
        "--room",
        "x" * ARGV_ROOM,
    ]


def wait_ready(socket_path: str | Path, alive: Callable[[], bool], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Block until the server at `socket_path` accepts connections; RuntimeError if it dies or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the warm start server for {socket_path} exited before it was ready")
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(socket_path))
            return
        time.sleep(0.1)
    raise RuntimeError(f"the warm start server for {socket_path} was not ready within {timeout_s:g} s")


# ---- the server ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildTask:
    """What a forked child runs: `python -m module` with this argv (the server's loop returns it in the child)."""

    argv: list[str]


class WarmServer:
    """`environ`: the server's environment before its imports; `read`: the variables those imports read. A
    request must agree with `environ` on every variable read at import (`read`, and the native ones). What the
    imports set or removed in the environment, a cold child's imports would too: each child gets the same."""

    def __init__(
        self, socket_path: Path, environ: Mapping[str, str], read: Set[str], modules: Sequence[str] = RUNNER_MODULES
    ) -> None:
        self.socket_path = socket_path
        self.modules = tuple(modules)
        self.read = frozenset(read)
        self.environ = dict(environ)
        self.import_set = {k: v for k, v in os.environ.items() if self.environ.get(k) != v}
        self.import_removed = set(self.environ) - set(os.environ)
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.wakeup_read, self.wakeup_write = os.pipe()
        self.children: dict[int, socket.socket] = {}  # pid -> its requester's connection
        self.pending: dict[socket.socket, _Lines] = {}  # connections whose request is not complete yet
        self.argv_area = _argv_area()
        self.stopping = False

    def run(self) -> ChildTask:
        """Serve until SIGTERM (then exit); returns only in a forked child, with what it must run."""
        for fd in (self.wakeup_read, self.wakeup_write):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only wakes the loop (through the wakeup fd)
        signal.signal(signal.SIGTERM, self._stop)
        self.listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self.listener.listen(64)
        self.selector.register(self.listener, selectors.EVENT_READ, self._accept)
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, self._reap)
        log.info("warm start server on %s (pid %d)", self.socket_path, os.getpid())
        while not self.stopping:
            for key, _ in self.selector.select():
                if task := key.data(key.fileobj):
                    return task
        self.socket_path.unlink(missing_ok=True)
        raise SystemExit(0)

    def _stop(self, *_: object) -> None:
        self.stopping = True

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        if _peer_uid(conn) not in (os.getuid(), None):  # the socket's mode already keeps others out
            conn.close()
            return
        self.pending[conn] = _Lines(conn)
        self.selector.register(conn, selectors.EVENT_READ, self._on_readable)

    def _on_readable(self, conn: socket.socket) -> ChildTask | None:
        if conn in self.pending:
            return self._on_request_data(conn)
        # A child's requester spoke after its request, or hung up: it died (nothing more is ever sent).
        self._drop(conn)
        for pid, owner in list(self.children.items()):
            if owner is conn:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        return None

    def _on_request_data(self, conn: socket.socket) -> ChildTask | None:
        lines = self.pending[conn]
        try:
            chunk, fds, _flags, _address = socket.recv_fds(conn, 1 << 20, STDIO_FDS)
        except OSError:
            chunk, fds = b"", []
        lines.fds += fds
        if not chunk:
            self._drop(conn)
            return None
        lines.buffer += chunk
        if b"\n" not in lines.buffer:
            return None
        try:
            request = _checked_request(lines.read(), len(lines.fds))
            reason = self.cold_reason(request)
        except ValueError as error:
            reason = f"malformed request: {error}"
        if reason:
            log.info("cold: %s", reason)
            _send(conn, {"cold": reason})
            self._drop(conn)
            return None
        del self.pending[conn]
        return self._fork(conn, request, lines.fds)

    def cold_reason(self, request: dict) -> str | None:
        """Why the requested child cannot be forked from here; None if it can."""
        argv, env, cwd = request["argv"], request["env"], request["cwd"]
        module = python_module(argv)
        if module is None or not module.startswith(self.modules):
            return f"only `{sys.executable} -m <module>` of {', '.join(self.modules)} starts warm"
        if differ := sorted(k for k in set(env) | set(self.environ) if self.differs(k, env.get(k))):
            return f"its environment differs from the warm server's in {', '.join(differ)}, read at import"
        if not Path(cwd).is_dir():
            return f"its working folder {cwd} does not exist"
        if self.argv_area is None or len(_nul_joined(argv)) > self.argv_area[1] - self.argv_area[0]:
            return "its command line does not fit the room the server reserved for it"
        if (threads := threading.active_count()) != 1:
            return f"the warm server runs {threads} Python threads and cannot fork safely"
        return None

    def differs(self, name: str, value: str | None) -> bool:
        """Whether a child with `value` for `name` could import otherwise than the server did. The value the
        server's own imports set (torch sets TORCHINDUCTOR_CACHE_DIR) is what a cold child's imports would
        find or set themselves: a requester that imported them first passes it on."""
        if value == self.environ.get(name) or not self.read_at_import(name):
            return False
        return name not in self.import_set or value != self.import_set[name]

    def read_at_import(self, name: str) -> bool:
        if name in READ_LATER:
            return False
        return name in self.read or name.startswith(NATIVE_PREFIXES) or name.startswith(ITERATED_PREFIXES)

    def _fork(self, conn: socket.socket, request: dict, stdio: list[int]) -> ChildTask | None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        # The child's garbage collections then skip every object the server holds (the preloaded libraries): each
        # full collection in a child wrote to all of their headers, copying the pages a fork shares, a large share
        # of a warm engine's start-up CPU; Python's gc docs advise it before a fork.
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            self._become_child(request, conn, stdio)
            return ChildTask(request["argv"])
        _close_all(stdio)
        self.children[pid] = conn
        log.info("pid %d: %s", pid, " ".join(request["argv"][2:4]))
        _send(conn, {"pid": pid})
        return None

    def _reap(self, wakeup: int) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(wakeup, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if (conn := self.children.pop(pid, None)) is not None:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        if lines := self.pending.pop(conn, None):
            _close_all(lines.fds)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)
        conn.close()

    def _become_child(self, request: dict, conn: socket.socket, stdio: list[int]) -> None:
        """In the forked child: what a cold start of `request` would be, but for what was already imported."""
        server = os.getppid()
        os.setsid()  # leads its own process group, as ManagedProcess's cold children do
        _die_with_parent()
        if os.getppid() != server:  # the server died before the line above
            os._exit(1)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _reset_logging()
        for other in [conn, *self.children.values(), *self.pending]:
            other.close()
        for lines in self.pending.values():  # other requests' descriptors
            _close_all(lines.fds)
        self.selector.close()
        self.listener.close()
        os.close(self.wakeup_read)
        os.close(self.wakeup_write)
        if request["log_path"] is None:
            _adopt_stdio(stdio)
        else:
            _redirect_stdio(request["log_path"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({k: v for k, v in request["env"].items() if k not in self.import_removed})
        os.environ.update(self.import_set)
        _write_cmdline(self.argv_area, request["argv"])
        if "numpy" in sys.modules:  # seeded from the OS at import in a cold process; a fork would copy the server's
            sys.modules["numpy"].random.seed()


def run_child(task: ChildTask) -> None:
    """`python -m module args...` in this (forked) process: a fresh __main__, argv and path as -m sets them."""
    sys.orig_argv = list(task.argv)
    sys.argv = [task.argv[2], *task.argv[3:]]
    sys.path[0] = os.getcwd()
    sys.modules["__main__"] = types.ModuleType("__main__")
    runpy._run_module_as_main(task.argv[2], alter_argv=True)  # type: ignore[attr-defined]  # what `python -m` calls


class _RecordingEnviron(os._Environ):
    """os.environ that notes each variable read by name (a lookup, `in`, get). A walk over all of it (dict(),
    .items(), a library looking for its prefix) reads each name in the order the walk began with, and is no read
    of them: a lookup out of that order ends the walk and counts."""

    def __init__(self, environ: os._Environ) -> None:
        data = environ._data  # type: ignore[attr-defined]  # the store itself (a private attribute)
        super().__init__(data, environ.encodekey, environ.decodekey, environ.encodevalue, environ.decodevalue)
        self.read: set[str] = set()
        self._walk: list[str] = []

    def __iter__(self) -> Iterator[str]:
        self._walk = list(super().__iter__())[::-1]  # popped from the end, in order
        return iter(self._walk[::-1])

    def __getitem__(self, key: str) -> str:
        if self._walk and self._walk[-1] == key:
            self._walk.pop()
        else:
            self._walk = []
            self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


def preload(modules: Sequence[str]) -> tuple[list[str], set[str]]:
    """Import what is installed of `modules`: (the ones imported, the environment variables their imports read)."""
    imported, original = [], os.environ
    os.environ = recording = _RecordingEnviron(original)  # shares the variables: what imports set lands in both
    try:
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError as error:
                log.info("not preloaded: %s (%s)", name, error)
                continue
            imported.append(name)
    finally:
        os.environ = original  # noqa: B003 - puts the object back; the variables are the same ones
    return imported, recording.read


def _checked_request(request: object, fds: int) -> dict:
    """The request, once it is {"argv": [str, ...], "env": {str: str}, "cwd": str, "log_path": str | null} with `fds`
    descriptors (none, or with a null log_path the child's three stdio); else ValueError."""
    if not isinstance(request, dict) or set(request) != {"argv", "env", "cwd", "log_path"}:
        raise ValueError('expected an object with exactly "argv", "env", "cwd" and "log_path"')
    argv, env = request["argv"], request["env"]
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
        raise ValueError("env must map names to strings")
    if not (isinstance(request["cwd"], str) and isinstance(request["log_path"], str | None)):
        raise ValueError("cwd must be a string and log_path a string or null")
    if fds != (STDIO_FDS if request["log_path"] is None else 0):
        raise ValueError(
            f"{fds} descriptors came with it: a null log_path takes {STDIO_FDS} (stdin, stdout, stderr), "
            "a log path none"
        )
    return request


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError):
        return None
    return uid


def _send(conn: socket.socket, message: dict) -> None:
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _reset_logging() -> None:
    """The root logger as a cold start has it: without the server's handler (main's basicConfig), whose records
    would reach the child's stderr and which would make the child's own basicConfig a no-op."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)


def _adopt_stdio(fds: Sequence[int]) -> None:
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    _close_all(fd for fd in fds if fd > 2)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _redirect_stdio(log_path: str) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    target = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(null)
    os.close(target)


def _argv_area() -> tuple[int, int] | None:
    """[start, end) of this process's command line in its memory (Linux's /proc/self/stat), or None."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[45]), int(fields[46])  # fields 48 and 49: arg_start, arg_end
    except (OSError, IndexError, ValueError):
        return None


def _nul_joined(argv: Sequence[str]) -> bytes:
    return b"".join(os.fsencode(arg) + b"\0" for arg in argv)


def _write_cmdline(area: tuple[int, int] | None, argv: Sequence[str]) -> None:
    """Rewrite the process's command line in place (what /proc/<pid>/cmdline and ps read): `argv`, then NULs to
    the end of the area, whose last byte stays NUL so the kernel reads it as plain arguments. CPython keeps its own
    copy of the original argv, so nothing reads this memory but the kernel."""
    if area is None:
        return
    start, end = area
    text = _nul_joined(argv)
    ctypes.memmove(start, text.ljust(end - start, b"\0"), end - start)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.procs.warm", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True, type=Path, help="the Unix socket to listen on")
    parser.add_argument("--room", default="", help="padding: command-line room for the forked children")
    parser.add_argument("--preload", nargs="*", default=list(PRELOAD), help="modules to import once")
    parser.add_argument("--modules", nargs="+", default=list(RUNNER_MODULES), help="module prefixes it forks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    environ, started = dict(os.environ), time.monotonic()
    imported, read = preload(args.preload)
    gc.collect()  # what the imports left as garbage is freed, not frozen with the rest before the first fork
    log.info(
        "preloaded %d modules in %.1f s, which read %d environment variables: %s",
        len(imported),
        time.monotonic() - started,
        len(read),
        ", ".join(imported),
    )
    task = WarmServer(args.socket, environ, read, args.modules).run()
    run_child(task)


if __name__ == "__main__":
    main()
