"""multi_lora_events.jsonl: one line per thing the loop did (retired, loaded, cleaned up, pushed, trained,
engines restarted), for audits of a run after the fact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EVENTS_FILE = "multi_lora_events.jsonl"


class EventLog:
    """Appends `{"iteration": ..., "event": ..., **fields}` lines; opened per write so a killed run loses none."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, iteration: int, event: str, **fields: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"iteration": iteration, "event": event, **fields}) + "\n")
