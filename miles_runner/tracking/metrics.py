"""Per-step metrics: appended to metrics.jsonl as they happen (a crash loses at most the step in flight)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class MetricsFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False) + "\n")
            out.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """On resume: drop records of steps after the checkpoint, which the resumed run will redo."""
        kept = [r for r in self.read() if r.get("step", -1) <= step]
        # Written aside and renamed over: a kill mid-write (a requeue, a preemption) leaves the old file or the
        # new one, never a half-written file that would lose the steps before the checkpoint.
        partial = self.path.with_name(self.path.name + ".tmp")
        with partial.open("w") as out:
            out.write("".join(json.dumps(r) + "\n" for r in kept))
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, self.path)


def _plain(value: Any) -> Any:
    """JSON-safe: tensors and numpy scalars as numbers, NaN and infinities as null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if value is None or isinstance(value, bool | int | float | str | list | dict) else str(value)
