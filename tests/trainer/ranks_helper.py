"""Run a worker module as a gloo world of N local processes (miles_testkit/ranks.py): ``run_ranks(worker_module,
world_size, args, timeout)`` starts `python -m worker_module args` once per rank, warm where it can be
(tests/drivers.py), and fails naming the module with every rank's output tail when any rank exits non-zero."""

from __future__ import annotations

from collections.abc import Sequence

from miles_testkit.ranks import run_ranks as run_world
from tests.drivers import runner_command


def run_ranks(worker_module: str, world_size: int, args: Sequence[str] = (), timeout: float = 120) -> None:
    run_world(runner_command(worker_module, *map(str, args)), world_size, timeout, worker_module)
