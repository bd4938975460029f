"""Colocated adapter sync: the adapter tensors travel in the request (spec §3.2 colocated path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_runner.engine.client import EngineClient
from miles_runner.engine.tensor_wire import lora_tensor_payloads
from miles_runner.lora.adapter_sync import AdapterSync, unload_quietly


class TensorSync(AdapterSync):
    """Colocated: unload, then load the adapter from tensors handed over in the request."""

    async def load(self, tensors: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:
        payload = lora_tensor_payloads(self.engine_kind, tensors, self.engine_tp)

        async def reload(client: EngineClient) -> None:
            if name in self.loaded:
                await unload_quietly(client, name)
            await client.load_lora_adapter_from_tensors(name, config, payload)

        await self._each(reload)

