"""One driver per run folder: the driver holds an exclusive lock on RUN_DIR/.driver.lock while it trains.

A resume (`--resume`, a requeued Slurm job, a user's second `miles-run`) must not start while the run's previous
driver still writes the folder's checkpoints and metrics: two writers would save the same step twice and
interleave their records. A SIGKILLed driver does not leave at once when something else holds its process (a
warm start's requester is killed, and the server then kills the driver; a Slurm step's processes end one by
one), so a new driver waits a moment for the lock before it gives up. The kernel drops the lock when the
holder's process ends, however it ends: no stale lock is ever left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".driver.lock"
WAIT_S = 30.0  # far longer than a killed driver takes to go; short enough that a real second driver is named soon


class RunFolderBusy(RuntimeError):
    """Another live driver trains in this run folder."""


@contextlib.contextmanager
def hold_run_folder(run_dir: Path, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold the run folder's lock for the body; waits up to `wait_s` for a previous driver to go."""
    path = Path(run_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _acquire(fd, path, wait_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _acquire(fd: int, path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise RunFolderBusy(_busy_message(path, wait_s)) from None
            time.sleep(0.1)


def _busy_message(path: Path, wait_s: float) -> str:
    holder = path.read_text().strip() or "unknown"
    return (
        f"run folder {path.parent} is in use by another driver (pid {holder}), still running after {wait_s:.0f} s; "
        "stop that run first, or give this one its own run.dir"
    )
