"""`AdaptersCache` (docs/system.md §4.3): the controller's snapshot, refreshed at most once per TTL, for the hot path.

Every request asks whether its adapter is still sampleable and at which version; one snapshot per second
serves them all. A failed refresh is logged and the last good snapshot kept (before the first success, no
adapter is sampleable, so nothing is generated for one that may already be gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 1.0
FetchSnapshot = Callable[[], Awaitable[RegistrySnapshot]]


class AdaptersCache:
    def __init__(
        self, fetch: FetchSnapshot, *, ttl_s: float = DEFAULT_TTL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._fetch = fetch
        self._ttl_s = ttl_s
        self._clock = clock
        self._snapshot = RegistrySnapshot()
        self._fetched_at: float | None = None
        self._lock = asyncio.Lock()

    async def snapshot(self) -> RegistrySnapshot:
        if self._fresh():
            return self._snapshot
        async with self._lock:  # one refresh at a time; the waiters then read its result
            if not self._fresh():
                await self._refresh()
        return self._snapshot

    async def get(self, name: str) -> AdapterRun | None:
        """The adapter if it is sampleable (ACTIVE or RETIRING), else None."""
        return (await self.get_all()).get(name)

    async def get_all(self) -> dict[str, AdapterRun]:
        return (await self.snapshot()).sampleable

    def _fresh(self) -> bool:
        return self._fetched_at is not None and self._clock() - self._fetched_at < self._ttl_s

    async def _refresh(self) -> None:
        try:
            self._snapshot = await self._fetch()
        except Exception as error:
            log.warning("adapter snapshot refresh failed, keeping the last one: %r", error)
        self._fetched_at = self._clock()  # a failure is retried after one TTL, not on every request


def in_process(snapshot: Callable[[], RegistrySnapshot]) -> FetchSnapshot:
    """A fetch for a controller in this process (e.g. `in_process(controller.snapshot)`)."""

    async def fetch() -> RegistrySnapshot:
        return snapshot()

    return fetch
