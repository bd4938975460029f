"""Run a worker module as a gloo world of N local processes (the torchrun environment, on loopback).

``run_ranks(worker_module, world_size, args, timeout)`` starts `python -m worker_module args` (warm where it can be:
tests/drivers.py) once per rank with MASTER_ADDR=127.0.0.1, a fresh MASTER_PORT, RANK/WORLD_SIZE/LOCAL_RANK and
OMP_NUM_THREADS=1; kills them all if one fails or the timeout passes; and raises with every rank's output tail when
any rank exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from miles_runner.procs.ports import LOOPBACK, free_port
from tests.drivers import runner_command

_TAIL = 4000  # characters of each rank's output kept in a failure message


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"}


def run_ranks(worker_module: str, world_size: int, args: Sequence[str] = (), timeout: float = 120) -> None:
    """Run ``python -m worker_module *args`` as ranks 0..world_size-1; AssertionError naming the failed ranks."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        outputs = [Path(logs) / f"rank{rank}.log" for rank in range(world_size)]
        procs = []
        for rank, output in enumerate(outputs):
            with output.open("wb") as sink:
                procs.append(subprocess.Popen(runner_command(worker_module, *map(str, args)),
                                              env=rank_env(rank, world_size, port), stdout=sink,
                                              stderr=subprocess.STDOUT))
        codes = _wait_all(procs, timeout)
        if codes != [0] * world_size:
            tails = "\n".join(f"--- rank {rank} (exit {code}) ---\n{output.read_text(errors='replace')[-_TAIL:]}"
                              for rank, (code, output) in enumerate(zip(codes, outputs, strict=True)))
            raise AssertionError(f"{worker_module}: ranks exited {codes}\n{tails}")


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes; on a timeout, or as soon as one rank fails (the others would hang in a collective), the rest
    are killed (their code is then the kill's)."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]
