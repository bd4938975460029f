"""The adapter sync protocol every strategy shares, once before the loop and after every train step
(docs/system.md §3.2 and §7).

    pause_generation(mode) -> flush_cache (colocated: always; disaggregated: unless in_place) -> push
    -> update_weight_version -> every engine reports that version (verify.py) -> continue_generation (always,
    even when the push failed)

One interface, two strategies: colocated engines receive the adapter tensors in the request
(`/load_lora_adapter_from_tensors`, unload first, docs/system.md §3.2 colocated path); disaggregated engines receive
them by a torch.distributed broadcast (see broadcast.py). Both bump the engines' weight_version, which every generated
sample carries back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles_runner.plan.model import Plan
from miles_runner.sglang_client.client import EngineClient, EngineError
from miles_runner.weight_sync.verify import check_engine_versions

FLUSH_RETRY_S = 0.05


@dataclass(frozen=True)
class SyncReport:
    version: int
    seconds: float
    engines: int
    bytes: int
    verify_seconds: float  # asking every engine for its weight version after the push
    shared_memory: bool = False  # the engines loaded the trainer's own tensors (TensorSync.share): no copy before


def tensor_bytes(tensors: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class AdapterSync:
    """Pushes adapters to every engine with the plan's pause, flush and version protocol: `lora_name` by
    default, or the name a push gives (multi-LoRA slots share one strategy, and one broadcast group)."""

    def __init__(
        self, clients: Sequence[EngineClient], plan: Plan, lora_name: str | None = None, *, flush_timeout_s: float = 60
    ):
        self.clients = list(clients)
        self.lora_name = lora_name
        self.engine_kind = plan.engines[0].kind
        self.engine_tp = plan.engines[0].tp_size  # tensors travel as one serialized copy per TP rank
        self.pause_mode = plan.weight_sync.pause_generation_mode
        self.flush = plan.weight_sync.flush_cache
        self.flush_timeout_s = flush_timeout_s
        self.loaded: set[str] = set()  # docs/system.md §3.2: the first load of a name does not unload
        self.loaded_shared = False  # whether the last load handed the engines the trainer's own tensors

    async def push(
        self, tensors: Mapping[str, Any], config: Mapping[str, Any], version: int, *, lora_name: str | None = None
    ) -> SyncReport:
        name = lora_name or self.lora_name
        if not name:
            raise ValueError("a push needs an adapter name: give lora_name, or make the sync with one")
        start = time.perf_counter()
        try:  # continue even when a pause failed: the engines that did pause must not stay paused
            await self._each(lambda c: c.pause_generation(self.pause_mode))
            if self.flush:
                await self._each(self._flush)
            await self.load(tensors, config, name)
            self.loaded.add(name)
            await self._each(lambda c: c.update_weight_version(str(version)))
            checked = time.perf_counter()
            await check_engine_versions(self.clients, version)  # each engine, not the router
            verify_s = time.perf_counter() - checked
        finally:
            await self._each(lambda c: c.continue_generation())
        seconds = time.perf_counter() - start
        return SyncReport(version, seconds, len(self.clients), tensor_bytes(tensors), verify_s, self.loaded_shared)

    async def load(self, tensors: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the strategy holds on the engines (the broadcast group); call once at shutdown."""

    async def reset(self) -> None:
        """Start over with engines that are new (restarted): nothing is loaded there, and no group is held."""
        await self.close()
        self.loaded.clear()

    async def _flush(self, client: EngineClient) -> None:
        deadline = time.monotonic() + self.flush_timeout_s
        while not await client.flush_cache():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{client.base_url} stayed busy; its cache could not be flushed before the sync")
            await asyncio.sleep(FLUSH_RETRY_S)

    async def _each(self, call: Callable[[EngineClient], Awaitable[Any]]) -> list[Any]:
        return await asyncio.gather(*(call(c) for c in self.clients))


async def unload_quietly(client: EngineClient, name: str) -> None:
    """Unload before reload; an adapter that is not loaded (a restarted engine) is not an error here."""
    with contextlib.suppress(EngineError):
        await client.unload_lora_adapter(name)
