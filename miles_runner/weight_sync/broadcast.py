"""Disaggregated adapter sync: a torch.distributed broadcast from the trainer into engines that keep running
(docs/system.md §3.2 "Disaggregated path", §4.7 for multi-LoRA).

The trainer is rank 0 of a dedicated weight-update group and engine i is rank i + 1: gloo on a CPU cluster,
NCCL on GPUs. Each push sends the adapter's metadata (names, dtype names, shapes) to every engine over HTTP
(`/load_lora_adapter_from_distributed`) while the trainer broadcasts each contiguous tensor, in `names`
order. A single adapter is unloaded first once it has been loaded (docs/system.md §3.2); with `upsert` (multi-LoRA
slots) the engines overwrite it in place and nothing is unloaded, so requests paused in place keep their adapter.

Constraints: the group is not the trainer's default process group (FSDP keeps its own), and only one
process, the trainer's rank 0, may run this sync. The tensors must be on the device the backend broadcasts
from (CPU for gloo, the current CUDA device for NCCL). A push that fails leaves the group out of step, so it
is torn down and built again on the next push; gloo cannot cut a broadcast short, so such a failure takes
up to `timeout_s` to report.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from miles_runner.plan.model import Plan
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.sglang_client.client import EngineClient, EngineError, EngineUnavailable
from miles_runner.sglang_client.weight_update_group import (
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
)
from miles_runner.weight_sync.adapter_sync import AdapterSync, unload_quietly

logger = logging.getLogger(__name__)

GROUP_NAME = "miles"  # the group name miles uses for its weight-update group
DEFAULT_TIMEOUT_S = 300.0


class BroadcastSync(AdapterSync):
    """Disaggregated: engines receive the adapter by broadcast from the trainer (rank 0 of a dedicated group)."""

    def __init__(
        self,
        clients: Sequence[EngineClient],
        plan: Plan,
        lora_name: str | None = None,
        *,
        upsert: bool = False,
        master_address: str = LOOPBACK,
        group_name: str = GROUP_NAME,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        flush_timeout_s: float = 60,
    ) -> None:
        super().__init__(clients, plan, lora_name, flush_timeout_s=flush_timeout_s)
        self.upsert = upsert
        self.backend = "gloo" if plan.cluster.cpu_only else "nccl"
        self.master_address = master_address  # where the engines reach the trainer's rendezvous store
        self.group_name = group_name
        self.timeout_s = timeout_s
        self._group: Any = None  # torch.distributed.ProcessGroup once connected

    async def load(self, tensors: Mapping[str, Any], config: Mapping[str, Any], name: str) -> None:

        group = await self._connect()
        names = list(tensors)
        payload = [tensors[name].detach().contiguous() for name in names]
        dtypes = [dtype_name(t.dtype) for t in payload]
        shapes = [list(t.shape) for t in payload]
        try:
            if name in self.loaded and not self.upsert:
                await self._each(lambda c: unload_quietly(c, name))
            send = asyncio.to_thread(broadcast_tensors, payload, group)
            receive = [
                c.load_lora_adapter_from_distributed(
                    name, config, names, dtypes, shapes, group_name=self.group_name, upsert=self.upsert
                )
                for c in self.clients
            ]
            _raise_first_error(await asyncio.gather(send, *receive, return_exceptions=True))
        except BaseException:
            await self.close()  # the group is out of step now; the next push builds a fresh one
            raise

    async def _connect(self) -> Any:
        """Build the group on first use: every engine joins over HTTP while the trainer joins as rank 0."""
        if self._group is not None:
            return self._group

        await self._each(self._destroy_quietly)  # a group left by an earlier trainer would refuse the init
        port = free_port(self.master_address)
        world_size = len(self.clients) + 1
        join_here = asyncio.to_thread(
            init_weight_update_group,
            backend=self.backend,
            master_address=self.master_address,
            master_port=port,
            rank=0,
            world_size=world_size,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
        )
        join_there = [
            client.init_weights_update_group(
                self.master_address, port, rank, world_size, group_name=self.group_name, backend=self.backend
            )
            for rank, client in enumerate(self.clients, start=1)
        ]
        results = await asyncio.gather(join_here, *join_there, return_exceptions=True)
        try:
            _raise_first_error(results)
        except BaseException:
            if not isinstance(results[0], BaseException):
                destroy_weight_update_group(results[0])
            await self._each(self._destroy_quietly)
            raise
        self._group = results[0]
        return self._group

    async def close(self) -> None:
        """Leave the group on every side (idempotent): on shutdown, and after a failed push."""

        await self._each(self._destroy_quietly)
        group, self._group = self._group, None
        if group is not None:
            destroy_weight_update_group(group)

    async def _destroy_quietly(self, client: EngineClient) -> None:
        with contextlib.suppress(EngineError, EngineUnavailable):  # it may not hold the group, or be gone
            await client.destroy_weights_update_group(self.group_name)


def _raise_first_error(results: Sequence[Any]) -> None:
    """Raise from `asyncio.gather(..., return_exceptions=True)` results: every call has finished (a collective's
    other side must finish or time out before the group can go), then the first engine error, which says
    why, or else the first error."""
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, EngineError)), errors[0])
