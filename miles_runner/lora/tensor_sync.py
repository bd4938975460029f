"""Colocated adapter sync: the adapter tensors travel in the request (spec §3.2 colocated path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles_runner.engine.client import EngineClient
from miles_runner.engine.tensor_wire import serialize_lora_tensors
from miles_runner.lora.adapter_sync import AdapterSync, unload_quietly


class TensorSync(AdapterSync):
    """Colocated: unload, then load the adapter from tensors handed over in the request."""

    async def load(self, tensors: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:
        payload = serialize_adapter(self.engine_kind, tensors)

        async def reload(client: EngineClient) -> None:
            if name in self.loaded:
                await unload_quietly(client, name)
            await client.load_lora_adapter_from_tensors(name, config, payload)

        await self._each(reload)


def serialize_adapter(engine_kind: str, tensors: Mapping[str, Any]) -> Any:
    """The `serialized_tensors` field as each engine kind expects it: a base64 safetensors blob for the
    embedded engine (it never unpickles a request), SGLang's MultiprocessingSerializer (CUDA IPC) on a GPU."""
    if engine_kind == "embedded":
        return serialize_lora_tensors(tensors)
    from sglang.srt.utils import MultiprocessingSerializer  # GPU extra only

    return MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True)
