"""Engines that restarted: dead engines are started again before each push (at most `executor.engine_restarts`
times each), and a push that failed is forgiven when an engine died under it. A restarted engine comes back
with no adapter and in no weight-update group; `engines_are_new` is how the pushes notice it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from miles_runner.executors.local import Executor
from miles_runner.sglang_client.client import EngineClient, EngineError, EngineUnavailable
from miles_runner.tracking.event_log import EventLog
from miles_runner.weight_sync.verify import SyncVerificationError

log = logging.getLogger(__package__)  # the loop's logger, named as before the split into modules

ENGINE_DEATH_WAIT_S = 10.0  # after a failed push: how long an engine may take to be seen dead
DEATH_POLL_S = 0.2


async def engines_are_new(engines: Sequence[EngineClient], version: int) -> bool:
    """An engine that does not report the last pushed weight version lost its adapters (or never had them)."""
    versions = await asyncio.gather(*(engine.weight_version() for engine in engines))
    return any(v != str(version) for v in versions)


class EngineRecovery:
    """Restarts the executor's dead engines and writes each restart to the event log."""

    def __init__(self, executor: Executor, events: EventLog) -> None:
        self.executor, self.events = executor, events

    async def restart_dead(self, iteration: int) -> list[int]:
        """Engines that died come back (the executor's `engine_restarts` allowing) before the next push."""
        started = time.perf_counter()
        restarted = await asyncio.to_thread(self.executor.restart_dead_engines)
        if restarted:
            seconds = round(time.perf_counter() - started, 3)
            self.events.write(iteration, "engines_restarted", engines=restarted, seconds=seconds)
        return restarted

    async def push_or_restart(self, push: Callable[[], Awaitable[float]], iteration: int) -> float | None:
        """Restart dead engines, then `push` (returns its seconds); None when an engine died under the push and was
        restarted (the next iteration's push then gives it every adapter)."""
        try:
            await self.restart_dead(iteration)
            return await push()
        except (EngineUnavailable, EngineError, RuntimeError) as error:
            if not await self.restarted_after(error, iteration):
                raise
            return None

    async def restarted_after(self, error: Exception, iteration: int) -> bool:
        """Whether `error` (a push or version check that failed) came from an engine that died: one is restarted
        within ENGINE_DEATH_WAIT_S (a killed engine is not reaped at once). Anything else is not ours to mend."""
        if isinstance(error, SyncVerificationError):
            return False  # the engines answered the push's probe: alive, holding weights that differ
        deadline = time.monotonic() + ENGINE_DEATH_WAIT_S
        while time.monotonic() < deadline:
            if await self.restart_dead(iteration):
                log.warning("an engine died (%r); it was restarted", error)
                return True
            await asyncio.sleep(DEATH_POLL_S)
        return False
