"""What gets pushed to the engines, and when: the adapters that stepped or are new (an upsert of each), or every loaded
one when the engines are new (the run's start, or an engine restarted and lost them). Every push is verified: each
engine reports its version (weight_sync/verify.py) and, with plan.weight_sync.verify, scores the push probe under the
pushed adapter as the trainer's slot does (weight_sync/probe.py); a failure names the iteration and the adapter, and the
run stops before the trainer steps again.

Under the fault switch MILES_FAULT_FREEZE_ROLLOUT_ADAPTER every push of an adapter sends its first pushed
weights again, under the new version: the probe must catch it at the adapter's first push after a step."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER, warn_fault_switches
from miles_runner.loops.multi_lora.recovery import engines_are_new
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.sglang_client.client import EngineClient
from miles_runner.tracking.event_log import EventLog
from miles_runner.trainer.interface import MultiLoRATrainer
from miles_runner.weight_sync.adapter_sync import AdapterSync
from miles_runner.weight_sync.probe import PushProbe
from miles_runner.weight_sync.verify import SyncVerificationError


class Pushes:
    """Tracks which loaded adapters the engines lack the latest weights of, and pushes them.

    Every push sets the engines' weight_version to the push count, so an engine that reports another version
    missed pushes (it is new) and gets every adapter again."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        sync: AdapterSync,
        trainer: MultiLoRATrainer,
        controller: ControllerClient,
        events: EventLog,
        probe: PushProbe | None = None,
    ) -> None:
        self.engines, self.sync, self.trainer, self.controller, self.events = engines, sync, trainer, controller, events
        self.probe = probe
        self.frozen: dict[str, dict[str, Any]] | None = {} if FREEZE_ROLLOUT_ADAPTER in warn_fault_switches() else None
        self.due: set[str] = set()  # adapters the engines do not have the latest weights of
        self.count = 0  # weight pushes so far: the engines' weight_version

    def want(self, names: Iterable[str]) -> None:
        """These adapters are new or stepped: the next update pushes them."""
        self.due.update(names)

    def forget(self, name: str) -> None:
        self.due.discard(name)

    async def update(self, loaded: Mapping[str, AdapterRun], iteration: int) -> float:
        """Push what is due (all of `loaded` to new engines); returns the seconds it took."""
        started = time.perf_counter()
        engines_new = bool(loaded) and await engines_are_new(self.engines, self.count)
        if engines_new:
            await self.sync.reset()  # a new engine holds no adapter and is in no weight-update group
        names = set(loaded) if engines_new else self.due & set(loaded)
        gaps: dict[str, float] = {}
        for name in sorted(names, key=lambda n: loaded[n].slot):
            try:
                gap = await self._push(loaded[name])
            except SyncVerificationError as error:
                raise SyncVerificationError(f"iteration {iteration}, adapter {name}: {error}") from None
            if gap is not None:
                gaps[name] = gap
        await self._record(sorted(self.due & names), iteration, gaps)
        if engines_new:
            self.events.write(iteration, "pushed_all", names=sorted(names), engine_adapters=await self._listed())
        self.due -= names
        return time.perf_counter() - started

    async def _push(self, run: AdapterRun) -> float | None:
        """Push the slot's adapter; the probe's largest engine gap (None without verification)."""
        self.count += 1
        state, config = self.trainer.adapter_state(run.slot), self.trainer.adapter_config(run.slot)
        if self.frozen is not None:  # the fault: the adapter's first pushed weights, under every later version
            state = self.frozen.setdefault(run.name, state)
        # One weight-update group serves every slot; the slot's engine adapter is upserted by name.
        await self.sync.push(state, config, self.count, lora_name=run.lora_name)
        if self.probe is not None:  # the trainer's slot holds exactly what was pushed until it steps again
            mine = await asyncio.to_thread(self.trainer.probe_log_probs, self.probe.token_ids, run.slot)
            report = await self.probe.check(mine, run.lora_name, what=f"weight version {self.count}")
            return max(report.gaps)
        return None

    async def _record(self, bumped: list[str], iteration: int, gaps: dict[str, float]) -> None:
        """The controller counts a weight version for each adapter that stepped or is new (not a mere re-push); the
        event keeps each pushed adapter's probe gap."""
        if bumped:
            await self.controller.record_weight_update(bumped)
            self.events.write(iteration, "pushed", names=bumped, probe_gaps={n: gaps[n] for n in bumped if n in gaps})

    async def _listed(self) -> list[list[str]]:
        """The adapters each engine lists in /v1/models (the base model first, left out), for the audit."""
        return [sorted(card["id"] for card in (await engine.list_models())[1:]) for engine in self.engines]
