"""A gloo world of N local processes, as torchrun starts it (on loopback): the two-process tests' and benchmarks'
launcher. Each rank gets MASTER_ADDR=127.0.0.1, one fresh MASTER_PORT, RANK/WORLD_SIZE/LOCAL_RANK and
OMP_NUM_THREADS=1, and its output in a log file of its own; one rank failing (the others would hang in a collective)
or the timeout kills the rest, and the error carries every rank's output tail."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from miles_runner.procs.ports import LOOPBACK, free_port

TAIL_CHARS = 4000  # of each rank's output in a failure's message


class RanksFailed(AssertionError):
    """A rank exited non-zero or the world ran out of time (an AssertionError: a test's failure, not its error)."""


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "OMP_NUM_THREADS": "1",
    }


def run_ranks(argv: Sequence[str], world_size: int, timeout_s: float, what: str) -> None:
    """Run `argv` as ranks 0..world_size-1 and wait for all; RanksFailed naming `what` unless every rank exits 0."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        outputs = [Path(logs) / f"rank{rank}.log" for rank in range(world_size)]
        procs = []
        for rank, output in enumerate(outputs):
            with output.open("wb") as sink:
                procs.append(
                    subprocess.Popen(
                        list(argv), env=rank_env(rank, world_size, port), stdout=sink, stderr=subprocess.STDOUT
                    )
                )
        codes = wait_all(procs, timeout_s)
        if codes != [0] * world_size:
            tails = "\n".join(
                f"--- rank {rank} (exit {code}) ---\n{output.read_text(errors='replace')[-TAIL_CHARS:]}"
                for rank, (code, output) in enumerate(zip(codes, outputs, strict=True))
            )
            raise RanksFailed(f"{what}: ranks exited {codes}\n{tails}")


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes; on a timeout, or as soon as one rank fails, the rest are killed (their code is then the kill's)."""
    deadline = time.monotonic() + timeout_s
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
