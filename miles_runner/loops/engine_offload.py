"""The engines' half of a colocated step under rollout offload, in the order of miles' train.py (docs/system.md §7):

    generate -> release the rollout's memory -> train -> onload the weights -> update the weights -> onload the rest

The tags are the plan's (`plan.weight_sync.offload_tags`: the CUDA graphs, the KV cache and the weights as
topology.offload_rollout_level names them). Each call is a line in RUN_DIR/offload_events.jsonl with its seconds and
what every engine reports released after it (the embedded engine's /server_info also says the bytes it freed), so a
run shows its order and its memory figures after the fact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_runner.core.sglang_protocol import WEIGHTS_TAG
from miles_runner.sglang_client.client import EngineClient
from miles_runner.tracking.event_log import EventLog

OFFLOAD_EVENTS_FILE = "offload_events.jsonl"


class EngineOffload:
    """Releases and takes back the engines' memory around training; every call logged."""

    def __init__(self, engines: Sequence[EngineClient], tags: Sequence[str], run_dir: Path) -> None:
        self.engines, self.tags = list(engines), list(tags)
        self.events = EventLog(Path(run_dir) / OFFLOAD_EVENTS_FILE)

    async def release(self, step: int) -> float:
        """After the rollout: give back every tag."""
        return await self._call(step, "offload_rollout", self.tags, release=True)

    async def onload_weights(self, step: int) -> float:
        """Before the push: the weights it lands on (nothing when the level keeps them)."""
        if WEIGHTS_TAG not in self.tags:
            return 0.0
        return await self._call(step, "onload_weights", [WEIGHTS_TAG], release=False)

    async def onload_rest(self, step: int) -> float:
        """After the push: the KV cache and the CUDA graphs, before the next rollout."""
        return await self._call(step, "onload_kv", [t for t in self.tags if t != WEIGHTS_TAG], release=False)

    def update(self, step: int, version: int, seconds: float) -> None:
        """The push between the onloads, logged in the same sequence."""
        self.events.write(step, "update_weights", version=version, seconds=seconds)

    async def _call(self, step: int, event: str, tags: list[str], *, release: bool) -> float:
        if not tags:
            return 0.0
        started = time.perf_counter()
        calls = [
            e.release_memory_occupation(tags) if release else e.resume_memory_occupation(tags) for e in self.engines
        ]
        await asyncio.gather(*calls)
        seconds = time.perf_counter() - started
        self.events.write(step, event, tags=tags, seconds=seconds, engines=await self._states())
        return seconds

    async def _states(self) -> list[dict[str, Any]]:
        """What each engine reports released (the embedded engine: tags and freed bytes; SGLang reports none)."""
        infos = await asyncio.gather(*(e.server_info() for e in self.engines))
        return [
            next((s["memory_occupation"] for s in info.get("internal_states", []) if "memory_occupation" in s), {})
            for info in infos
        ]
