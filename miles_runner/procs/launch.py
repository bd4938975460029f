"""Start a component from its plan line: the one way the runner turns argv into a supervised process.

Engines, the router, the session server, the multi-LoRA controller (from their `Launch`) and trainer ranks
all start here, so every child gets the same treatment: the run's interpreter and router
binary, a log under the run folder, a health check where the component has one, and a busy port named
before anything starts.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from miles_runner.plan.model import Launch
from miles_runner.plan.render import PYTHON
from miles_runner.procs.ports import port_holders, port_is_free
from miles_runner.procs.process import ManagedProcess


class PortBusyError(RuntimeError):
    """A component's port is taken by another process; nothing was started."""


def router_executable() -> str:
    """The `sglang-router` console script of this interpreter's environment (else the one on PATH)."""
    beside_python = Path(sys.executable).with_name("sglang-router")
    found = str(beside_python) if beside_python.exists() else shutil.which("sglang-router")
    if found is None:
        raise FileNotFoundError("sglang-router is not installed: pip install sglang-router==0.3.2")
    return found


def resolve_argv(argv: Sequence[str]) -> list[str]:
    """Plans say `python` and `sglang-router`; locally that is this interpreter and its environment's router."""
    head = argv[0]
    if head == PYTHON:
        head = sys.executable
    elif head == "sglang-router":
        head = router_executable()
    return [head, *argv[1:]]


def busy_ports(named: Sequence[tuple[str, Launch]]) -> list[str]:
    """Each component whose port is taken, with the processes that hold it where this host can tell."""
    busy = [(name, launch) for name, launch in named if not port_is_free(launch.host, launch.port)]
    return [f"{name} on {launch.host}:{launch.port}{_held_by(launch.port)}" for name, launch in busy]


def _held_by(port: int) -> str:
    holders = port_holders(port)
    return f" (held by {'; '.join(holders)})" if holders else ""


def check_ports(named: Sequence[tuple[str, Launch]]) -> None:
    """PortBusyError naming every component whose port is taken (call before starting any of them)."""
    if busy := busy_ports(named):
        raise PortBusyError(f"ports in use, nothing was started: {', '.join(busy)}")


def launch_process(
    name: str, launch: Launch, log_dir: Path, *, startup_timeout_s: float, cwd: Path | None = None
) -> ManagedProcess:
    """The component of a plan line as a supervised process, not yet started (`with` or start() runs it)."""
    return ManagedProcess(
        name,
        resolve_argv(launch.argv),
        env=launch.env,
        cwd=cwd,
        log_path=Path(log_dir) / f"{name}.log",
        health_url=launch.url + launch.health_path if launch.health_path else None,
        startup_timeout_s=startup_timeout_s,
    )
