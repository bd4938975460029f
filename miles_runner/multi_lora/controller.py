"""The multi-LoRA controller (docs/system.md §4.3): the registry, the checks at registration, and aborts on the engines.

A plain class whose methods are the ones a Ray actor would expose; today it runs inside the controller's
HTTP service (`http_server`), and the driver reaches it through `client.ControllerClient`, which has the
same methods. Not thread-safe: call it from one event loop (the service's), as a Ray async actor would.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

from miles_runner.core.adapters import AdapterLimits, rid_prefix
from miles_runner.multi_lora.config import AdapterDefaults, resolve_adapter_config
from miles_runner.multi_lora.registry import AdapterRegistry, AdapterState, RegistrySnapshot
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import EngineSource

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 30.0


class MultiLoRAController:
    def __init__(
        self,
        defaults: AdapterDefaults,
        limits: AdapterLimits,
        engines: EngineSource,
        *,
        abort_timeout_s: float = ABORT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> None:
        self.defaults = defaults
        self.limits = limits
        self.registry = AdapterRegistry(limits.max_slots)
        self._engines = engines
        self._abort_timeout_s = abort_timeout_s
        self._api_key = api_key  # the run's key: a keyed engine refuses an abort without it

    # ---- registration -------------------------------------------------------------------------------

    def register_adapter(self, name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Check and register; ValueError for a bad config or name, NoFreeSlotError when the slots are full."""
        config = resolve_adapter_config(name, overrides, self.defaults, self.limits)
        return self.registry.register(name, config)

    def deregister_adapter(self, name: str) -> str:
        """Mark only: the aborts and the slot release happen when the driver next reconciles."""
        return str(self.registry.deregister(name))

    # ---- driver-side lifecycle ----------------------------------------------------------------------

    async def retire_adapters(self) -> list[str]:
        """RETIRING -> CLEANUP, then abort each retired adapter's in-flight requests on every engine."""
        retired = self.registry.retire_adapters()
        await asyncio.gather(*(self.abort_adapter_requests(name) for name in retired))
        return retired

    async def free_slot(self, name: str) -> int:
        """Abort once more (multi-turn stragglers may have been submitted since), then release the slot."""
        if self.registry.state_of(name) is AdapterState.CLEANUP:
            await self.abort_adapter_requests(name)
        return self.registry.free_slot(name)

    async def abort_adapter_requests(self, name: str) -> None:
        """POST /abort_request {"rid": "<name>::", "prefix": true} to every engine; failures are only logged."""
        try:
            urls = await self._engines()
        except Exception as error:
            log.warning("aborting adapter %s: could not list the engines: %r", name, error)
            return
        results = await asyncio.gather(*(self._abort_on(url, name) for url in urls), return_exceptions=True)
        for url, result in zip(urls, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("aborting adapter %s on %s failed: %r", name, url, result)

    async def _abort_on(self, url: str, name: str) -> None:
        async with EngineClient(url, api_key=self._api_key, timeout_s=self._abort_timeout_s) as engine:
            await engine.abort_request(rid_prefix(name), prefix=True)

    def record_weight_update(self, names: Iterable[str]) -> None:
        self.registry.record_weight_update(names)

    def record_batch_adapters(
        self, rollout_id: str, group_counts: Mapping[str, int], step_names: Iterable[str]
    ) -> None:
        self.registry.record_batch_adapters(rollout_id, group_counts, step_names)

    def mark_batch_trained(self, rollout_id: str) -> list[str]:
        return self.registry.mark_batch_trained(rollout_id)

    def resolve_num_step(self, name: str, rows: int) -> int:
        return self.registry.resolve_num_step(name, rows)

    def set_adapter_step(self, name: str, step: int) -> None:
        self.registry.set_step(name, step)

    def adapter_step(self, name: str) -> int:
        return self.registry.adapter_step(name)

    # ---- views --------------------------------------------------------------------------------------

    def snapshot(self) -> RegistrySnapshot:
        return self.registry.snapshot()

    def adapter_status(self, name: str) -> dict[str, Any]:
        return self.registry.status(name)

    def adapter_statuses(self) -> list[dict[str, Any]]:
        return self.registry.statuses()

    def adapter_states(self, names: Iterable[str]) -> dict[str, str | None]:
        return {name: _state_name(self.registry.state_of(name)) for name in names}


def _state_name(state: AdapterState | None) -> str | None:
    return None if state is None else str(state)
