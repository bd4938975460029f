"""Colocated adapter sync: the adapter tensors are handed over in the request (docs/system.md §3.2 colocated path).

SGLang engines get MultiprocessingSerializer bytes (CUDA IPC handles on GPUs). Embedded engines on the trainer's
host get a handle to a shared-memory segment (sglang_client/tensor_shm.py), the CPU analogue: the segment the trainer's
adapter parameters live in, once the trainer has moved them there (`share`; then a push copies nothing before the
engines' own load, as with CUDA IPC), else one the sync rewrites for every push. Any other embedded engine, or one
that cannot open the segment (another /dev/shm, as in a container), gets the tensors inline as base64 safetensors,
from then on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pybase64
import torch

from miles_runner.plan.model import Plan
from miles_runner.sglang_client.client import EngineClient, EngineError
from miles_runner.sglang_client.tensor_shm import SharedTensors, TensorSegment, on_this_host, shared_memory_available
from miles_runner.sglang_client.tensor_wire import lora_tensor_payloads
from miles_runner.weight_sync.adapter_sync import AdapterSync, unload_quietly

SEGMENT_REFUSED = "tensor segment"  # what the engine's error says when it cannot open or read a segment


class TensorSync(AdapterSync):
    """Colocated: unload, then load the adapter from tensors handed over in the request. `shared_memory=False`
    sends every embedded engine the tensors inline (the bench measures both)."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        plan: Plan,
        lora_name: str | None = None,
        *,
        shared_memory: bool = True,
        flush_timeout_s: float = 60,
    ) -> None:
        super().__init__(clients, plan, lora_name, flush_timeout_s=flush_timeout_s)
        shared = shared_memory and self.engine_kind == "embedded" and shared_memory_available()
        self._by_handle = {c.base_url for c in self.clients if shared and on_this_host(c.base_url)}
        self._segment: TensorSegment | None = None  # the hand-off segment, rewritten by each push
        self._shared: SharedTensors | None = None  # the trainer's adapter parameters, where `share` put them
        self._writing = asyncio.Lock()  # one push at a time rewrites the segment (multi-LoRA slots share a sync)

    async def load(self, tensors: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:
        async with self._writing:
            inline = functools.cache(lambda: lora_tensor_payloads(self.engine_kind, tensors, self.engine_tp))
            shared = self._shared.handle_for(tensors) if self._shared is not None and self._by_handle else None
            handle = self._handle_entries(shared or self._write_segment(tensors)) if self._by_handle else None

            async def reload(client: EngineClient) -> None:
                if name in self.loaded:
                    await unload_quietly(client, name)
                if handle is None or client.base_url not in self._by_handle:
                    await client.load_lora_adapter_from_tensors(name, config, inline())
                    return
                try:
                    await client.load_lora_adapter_from_tensors(name, config, handle)
                except EngineError as exc:
                    if SEGMENT_REFUSED not in str(exc):
                        raise
                    self._by_handle.discard(client.base_url)  # it cannot see our segments: inline from now on
                    await client.load_lora_adapter_from_tensors(name, config, inline())

            await self._each(reload)
            self.loaded_shared = shared is not None and all(c.base_url in self._by_handle for c in self.clients)

    def share(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """Shared-memory homes for `tensors` (a trainer's adapter parameters, which their owner then moves there),
        holding their values: a push of exactly those tensors hands engines on this host a handle to them, with no
        copy before the engine's own. None where no engine reads handles or the tensors cannot move: push copies."""
        if not self._by_handle:
            return None
        if self._shared is not None:
            self._shared.close()
        try:
            self._shared = SharedTensors(tensors)
        except (TypeError, ValueError):  # a dtype safetensors has no name for; a dtype mix that breaks alignment
            self._shared = None
        return None if self._shared is None else self._shared.tensors

    async def reset(self) -> None:
        """Restarted engines: nothing is loaded there; the trainer's shared tensors stay where they are."""
        self._close_segment()
        self.loaded.clear()

    async def close(self) -> None:
        await super().close()
        self._close_segment()
        if self._shared is not None:
            self._shared.close()  # the parameters keep the memory; only the segment's name goes
            self._shared = None

    def _close_segment(self) -> None:
        if self._segment is not None:
            self._segment.close()
            self._segment = None

    def _write_segment(self, tensors: Mapping[str, Any]) -> bytes | None:
        """The hand-off segment's handle, rewritten with `tensors`; None for tensors of a dtype the segment has no
        name for, which then travel inline."""
        if self._segment is None:
            self._segment = TensorSegment()
        try:
            return self._segment.write(tensors.items())
        except TypeError:
            return None

    def _handle_entries(self, handle: bytes | None) -> list[str] | None:
        """One entry per TP rank: every rank reads the same segment."""
        return None if handle is None else [pybase64.b64encode_as_string(handle)] * self.engine_tp
