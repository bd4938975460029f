"""The order in which `make test` hands the test files to its workers (`--dist loadfile --no-loadscope-reorder`:
a worker that is free takes the next file in this order). On 2 cores the suite is CPU-bound, so the order's job
is to keep both cores busy: a file that spends its time waiting (on Slurm, on Ray, on a timeout it proves) should
run beside one that computes, not beside another that waits.

1. The Slurm file (2.5 min, a third of it waiting on the scheduler and the jobs' start-up) and the learning proofs
   (`learning`: minutes of training, CPU-bound), so that these start at once, side by side. The Slurm file had
   come last: one worker ran it alone for 70-85 s while the other had nothing left.
2. The other files with a `slow` test, in collection order. A file that starts a local Ray in the worker must
   come after tests/executors/test_ray_address.py (its docstring says why): none of the files before it does.
3. The rest: the files that start processes (`integration`, which wait as much as they compute) interleaved
   with the in-process ones, each list spread evenly over the other, in collection order within each. In
   collection order the integration files came in runs (embedded_engine/, engine/, session/, ...), during which
   both workers waited at once.

Within a file the tests keep their order.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

FIRST_MARKERS = ("slurm", "learning")


def file_order(items: Sequence[pytest.Item]) -> dict[Path, tuple[int, float]]:
    """Each test file's sort key: (phase, position within the phase)."""
    files = list(dict.fromkeys(item.path for item in items))  # collection order
    marked = {name: _files_marked(items, name) for name in (*FIRST_MARKERS, "slow", "integration")}
    first = [f for name in FIRST_MARKERS for f in files if f in marked[name]]  # the Slurm file, then the proofs
    first = list(dict.fromkeys(first))
    slow = [f for f in files if f in marked["slow"] and f not in first]
    rest = [f for f in files if f not in first and f not in slow]
    waiting = [f for f in rest if f in marked["integration"]]
    computing = [f for f in rest if f not in marked["integration"]]
    order = {f: (0, float(i)) for i, f in enumerate(first)}
    order |= {f: (1, float(i)) for i, f in enumerate(slow)}
    order |= _spread(waiting) | _spread(computing)
    return order


def _files_marked(items: Sequence[pytest.Item], marker: str) -> set[Path]:
    return {item.path for item in items if item.get_closest_marker(marker)}


def _spread(files: list[Path]) -> dict[Path, tuple[int, float]]:
    """Positions from 0 to 1, evenly spaced: two lists spread so merge into one that alternates in proportion."""
    return {f: (2, (i + 0.5) / len(files)) for i, f in enumerate(files)}
