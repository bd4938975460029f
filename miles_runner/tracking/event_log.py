"""Event logs: one JSON line per thing a loop did (the multi-LoRA loop's retirements, loads, pushes and trainings;
engine restarts; a colocated step's offload calls), for audits of a run after the fact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class EventLog:
    """Appends `{"iteration": ..., "event": ..., **fields}` lines; opened per write so a killed run loses none."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, iteration: int, event: str, **fields: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"iteration": iteration, "event": event, **fields}) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """Every line written so far (none before the first write)."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
