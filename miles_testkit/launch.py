"""Test and bench tooling: start an engine from the argv the plan rendered, or the router in front of engines,
health-checked, as supervised processes (the runner itself starts them through miles_runner.procs.launch).

Real SGLang (`python -m sglang.launch_server ...`, GPU) and the embedded engine
(`python -m miles_runner.embedded_engine ...`, CPU) take the same flags, so one launcher serves both.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles_runner.procs.launch import router_executable
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.procs.process import ManagedProcess
from miles_runner.sglang_client.router import router_argv, wait_for_workers

HEALTH_PATHS = ("/health", "/health_generate")
_ANY_ADDRESS = ("0.0.0.0", "::", "")


def argv_flag(argv: Sequence[str], flag: str) -> str | None:
    """The value of `--flag VALUE` or `--flag=VALUE` in an argv (the last one wins, as with argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def embedded_engine_argv(model_path: str | Path, port: int, *flags: str) -> list[str]:
    """The embedded engine's command line on loopback at `port`, with `flags` (SGLang's, which it takes) after."""
    return [
        sys.executable,
        "-m",
        "miles_runner.embedded_engine",
        "--model-path",
        str(model_path),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *flags,
    ]


def engine_url(argv: Sequence[str], port: int) -> str:
    """Where the engine started from `argv` answers (an engine bound to all addresses: on loopback)."""
    host = argv_flag(argv, "--host") or LOOPBACK
    return f"http://{LOOPBACK if host in _ANY_ADDRESS else host}:{port}"


def engine_process(
    argv: Sequence[str],
    *,
    port: int,
    log_path: str | Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    health_path: str = "/health",
    name: str | None = None,
) -> ManagedProcess:
    """The supervised engine process, not yet started: start several, then wait for each, to overlap their
    start-up. ValueError if `port` is not the `--port` in `argv`."""
    if health_path not in HEALTH_PATHS:
        raise ValueError(f"health_path must be one of {HEALTH_PATHS}, got {health_path!r}")
    if argv_flag(argv, "--port") != str(port):
        raise ValueError(f"argv has --port {argv_flag(argv, '--port')}, but the engine is expected on {port}")
    return ManagedProcess(
        name or f"engine:{port}",
        argv,
        env=env,
        log_path=log_path,
        health_url=engine_url(argv, port) + health_path,
        startup_timeout_s=timeout_s,
    )


def start_engine(argv: Sequence[str], *, port: int, log_path: str | Path, **options: Any) -> ManagedProcess:
    """Start the engine and wait until its health path answers 200 (`options` as for `engine_process`).

    Raises ProcessStartError (exit code and log tail, process group stopped) if it exits or is not healthy
    within `timeout_s`.
    """
    process = engine_process(argv, port=port, log_path=log_path, **options)
    process.start()
    process.wait_healthy()
    return process


def start_router(
    worker_urls: Sequence[str],
    *,
    port: int,
    log_path: str | Path,
    policy: str = "cache_aware",
    extra: Sequence[str] = (),
    host: str = LOOPBACK,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> ManagedProcess:
    """Start the router in front of running, healthy engines; return once it answers /health and lists
    every one of `worker_urls` (a worker it cannot reach at start is silently left out, so this checks)."""
    argv = router_argv(
        host, port, worker_urls, policy, extra, metrics_port=free_port(host), executable=router_executable()
    )
    url = f"http://{host}:{port}"
    process = ManagedProcess(
        f"router:{port}",
        argv,
        env=env,
        log_path=log_path,
        health_url=f"{url}/health",
        startup_timeout_s=timeout_s,
    )
    process.start()
    process.wait_healthy()
    wait_for_workers(process, url, worker_urls, timeout_s)
    return process
