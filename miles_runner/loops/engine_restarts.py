"""Engines that die under a single-adapter run (`executor.engine_restarts`).

With restarts allowed, an engine that died is started again on its port (the executor counts each engine's
restarts and raises EngineLostError, naming the engine, once they are used up), and the run goes on where it was:
- a rollout that failed is generated again from the same prompts, once the engines hold the adapter of the last
  push again (at its version: a restarted engine comes back with no adapter and in no weight-update group);
- a push that failed is sent again to the engines, the restarted one included.
Each step is trained once: only a rollout that came back whole is trained on. Each restart is a line in
RUN_DIR/engine_events.jsonl. With no restarts (0, the default) nothing here acts: the failure ends the run and the
executor names the dead engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_runner.executors.local import Executor
from miles_runner.loops.multi_lora.recovery import EngineRecovery
from miles_runner.tracking.event_log import EventLog
from miles_runner.weight_sync.adapter_sync import AdapterSync, SyncReport

ENGINE_EVENTS_FILE = "engine_events.jsonl"


class EngineRestarts:
    """Restarts dead engines for the single-adapter loop, and puts the engines back in the state the loop expects."""

    def __init__(self, executor: Executor, sync: AdapterSync, run_dir: Path, limit: int) -> None:
        self.sync = sync
        self.recovery = EngineRecovery(executor, EventLog(Path(run_dir) / ENGINE_EVENTS_FILE)) if limit > 0 else None
        self.count = 0  # engine deaths recovered from so far
        # The last push, kept (copied: the trainer's tensors move on) so that restarted engines can get it again.
        self.last_push: tuple[dict[str, Any], dict[str, Any], int] | None = None

    async def push(self, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int, step: int) -> SyncReport:
        """Push to every engine; when an engine died under the push, restart it and push again."""
        try:
            report = await self.sync.push(tensors, config, version)
        except Exception as error:
            if not await self._restarted_after(error, step):
                raise
            await self.sync.reset()
            report = await self.sync.push(tensors, config, version)
        if self.recovery is not None:
            self.last_push = ({name: _copy(t) for name, t in tensors.items()}, dict(config), version)
        return report

    async def recovered_rollout(self, error: Exception, step: int, deaths_before: int) -> bool:
        """Whether a rollout that failed with `error` may be generated again: an engine died and is back, holding
        the last push (`deaths_before`: the count when the rollout started; a push since may have recovered)."""
        if self.recovery is None:
            return False
        if self.count > deaths_before:
            return True  # the push after the rollout met the dead engine first, and brought it back
        if not await self._restarted_after(error, step):
            return False
        if self.last_push is not None:
            tensors, config, version = self.last_push
            await self.sync.reset()
            await self.sync.push(tensors, config, version)
        return True

    async def _restarted_after(self, error: Exception, step: int) -> bool:
        if self.recovery is None or not await self.recovery.restarted_after(error, step):
            return False
        self.count += 1
        return True


def _copy(tensor: Any) -> Any:
    return tensor.detach().clone() if hasattr(tensor, "detach") else tensor
