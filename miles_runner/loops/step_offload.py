"""A colocated step's offload calls, in the order of miles' train.py (docs/system.md §7):

    generate -> offload the rollout -> train -> offload the trainer -> onload the weights -> update the weights
    -> onload the KV cache

The engines' tags are the plan's (`plan.weight_sync.offload_tags`: the CUDA graphs, the KV cache and the weights
as topology.offload_rollout_level names them); the trainer's state goes where trainer.offload_target says
(trainer/train_offload.py) and comes back before the next train. Each call is a line in
RUN_DIR/offload_events.jsonl with its seconds, and for the engines what each reports released after it and its
resident memory (the embedded engine's /server_info), so a run shows its order and its memory figures after the
fact.
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
from miles_runner.trainer.interface import Trainer

OFFLOAD_EVENTS_FILE = "offload_events.jsonl"
MB = 2**20


def empty_figures() -> dict[str, float]:
    return {"offload/seconds": 0.0, "offload/engine_freed_mb": 0.0, "offload/trainer_moved_mb": 0.0}


class StepOffload:
    """Releases and takes back the engines' memory and the trainer's state around training; every call logged."""

    def __init__(
        self, engines: Sequence[EngineClient], tags: Sequence[str], trainer: Trainer | None, run_dir: Path
    ) -> None:
        """`tags`: empty when the engines stay resident; `trainer`: None when it does."""
        self.engines, self.tags, self.trainer = list(engines), list(tags), trainer
        self.events = EventLog(Path(run_dir) / OFFLOAD_EVENTS_FILE)
        self._figures = empty_figures()  # since the last take_figures

    def take_figures(self) -> dict[str, float]:
        """What the offload calls took and moved since the last time asked: a step's `offload/*` metrics (the
        seconds; the MB the engines report freed by the release, where they report it; the MB the trainer moved)."""
        figures, self._figures = self._figures, empty_figures()
        return figures

    # ---- the engines ----

    async def release(self, step: int) -> float:
        """After the rollout: give back every tag."""
        return await self._engines(step, "offload_rollout", self.tags, release=True)

    async def onload_weights(self, step: int) -> float:
        """Before the push: the weights it lands on (nothing when the level keeps them)."""
        if WEIGHTS_TAG not in self.tags:
            return 0.0
        return await self._engines(step, "onload_weights", [WEIGHTS_TAG], release=False)

    async def onload_rest(self, step: int) -> float:
        """After the push: the KV cache and the CUDA graphs, before the next rollout."""
        return await self._engines(step, "onload_kv", [t for t in self.tags if t != WEIGHTS_TAG], release=False)

    def update(self, step: int, version: int, seconds: float) -> None:
        """The push between the onloads, logged in the same sequence."""
        self.events.write(step, "update_weights", version=version, seconds=seconds)

    # ---- the trainer ----

    async def offload_trainer(self, step: int) -> float:
        """After the train (and the save): the trainer's state leaves while the engines work."""
        return await self._trainer(step, "offload_train", offload=True)

    async def onload_trainer(self, step: int) -> float:
        """Before the train."""
        return await self._trainer(step, "onload_train", offload=False)

    # ---- calls ----

    async def _engines(self, step: int, event: str, tags: list[str], *, release: bool) -> float:
        if not tags:
            return 0.0
        started = time.perf_counter()
        calls = [
            e.release_memory_occupation(tags) if release else e.resume_memory_occupation(tags) for e in self.engines
        ]
        await asyncio.gather(*calls)
        seconds, states = time.perf_counter() - started, await self._states()
        self._figures["offload/seconds"] += seconds
        if release:
            freed = sum(sum(state.get("freed_bytes", {}).values()) for state in states)
            self._figures["offload/engine_freed_mb"] += freed / MB
        self.events.write(step, event, tags=tags, seconds=seconds, engines=states)
        return seconds

    async def _trainer(self, step: int, event: str, *, offload: bool) -> float:
        if self.trainer is None:
            return 0.0
        call = self.trainer.offload_state if offload else self.trainer.onload_state
        started = time.perf_counter()
        report = await asyncio.to_thread(call)
        seconds = time.perf_counter() - started
        self._figures["offload/seconds"] += seconds
        if offload:
            self._figures["offload/trainer_moved_mb"] += report["moved_bytes"] / MB
        self.events.write(step, event, seconds=seconds, **report)
        return seconds

    async def _states(self) -> list[dict[str, Any]]:
        """What each engine reports released (the embedded engine: tags, freed bytes, resident memory; SGLang
        reports none)."""
        infos = await asyncio.gather(*(e.server_info() for e in self.engines))
        return [
            next((s["memory_occupation"] for s in info.get("internal_states", []) if "memory_occupation" in s), {})
            for info in infos
        ]
