"""The engine's named weight-update groups (``/init_weights_update_group`` and the ``*_from_distributed``
routes): join, receive broadcast tensors, leave.

Joining and receiving block (until every rank has joined, until rank 0 has sent), so they run on a daemon
thread of their own: the event loop keeps answering and the scheduler keeps generating meanwhile, and a
receive still waiting at shutdown does not hold the process. Operations are serialised: one collective at a
time, so the order of receives is the order of requests. Every failure is a ``ValueError`` (HTTP 400); a
receive that failed leaves the group out of step with the trainer, so the group is destroyed and the
trainer must init it again.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from miles_runner.embedded_engine.scheduler import settle_future
from miles_runner.sglang_client.weight_update_group import (
    broadcast_tensors,
    destroy_weight_update_group,
    init_weight_update_group,
    parse_dtype,
    receive_tensors,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WeightUpdateGroups:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._lock = asyncio.Lock()

    async def init(
        self, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
    ) -> None:
        if backend != "gloo":
            raise ValueError(f"backend {backend!r} is not available: the embedded engine runs on CPU; use 'gloo'.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank_offset {rank} is outside the group of world_size {world_size}.")
        async with self._lock:
            if group_name in self._groups:
                raise ValueError(f"Weight update group {group_name!r} is already initialized; destroy it first.")
            join = lambda: init_weight_update_group(  # noqa: E731
                backend=backend,
                master_address=master_address,
                master_port=master_port,
                rank=rank,
                world_size=world_size,
                group_name=group_name,
                timeout_s=self.timeout_s,
            )
            try:
                self._groups[group_name] = await _on_daemon_thread(join)
            except Exception as exc:
                raise ValueError(f"Failed to init weight update group {group_name!r}: {exc}") from exc

    async def destroy(self, group_name: str) -> None:
        async with self._lock:
            destroy_weight_update_group(self._take(group_name))

    async def receive(
        self,
        group_name: str,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The tensors rank 0 broadcasts next, in ``names`` order (checked before anything is received): written
        into ``into`` (tensors of these names, shapes and dtypes) when given, else into new tensors."""
        parsed = [parse_dtype(d) for d in dtypes]
        async with self._lock:
            group = self._get(group_name)
            try:
                if into is None:
                    tensors = await _on_daemon_thread(lambda: receive_tensors(parsed, shapes, group))
                else:
                    tensors = [into[name] for name in names]
                    await _on_daemon_thread(lambda: broadcast_tensors(tensors, group))
            except Exception as exc:
                destroy_weight_update_group(self._take(group_name))
                raise ValueError(
                    f"Receiving tensors on weight update group {group_name!r} failed ({exc}); the group is "
                    "destroyed, init it again."
                ) from exc
        return dict(zip(names, tensors, strict=True))

    def _get(self, group_name: str) -> dist.ProcessGroup:
        if group_name not in self._groups:
            known = ", ".join(sorted(self._groups)) or "none"
            raise ValueError(
                f"Weight update group {group_name!r} is not initialized (initialized: {known}); "
                "call /init_weights_update_group first."
            )
        return self._groups[group_name]

    def _take(self, group_name: str) -> dist.ProcessGroup:
        group = self._get(group_name)
        del self._groups[group_name]
        return group


async def _on_daemon_thread(fn: Callable[[], T]) -> T:
    """``await fn()`` run on a new daemon thread (a blocked collective must not keep the process alive)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def run() -> None:
        try:
            outcome, failed = fn(), None
        except BaseException as exc:  # handed to the awaiting request, which answers 400
            outcome, failed = None, exc
        if not loop.is_closed():
            loop.call_soon_threadsafe(settle_future, future, outcome, failed)

    threading.Thread(target=run, name="weight-update-group", daemon=True).start()
    return await future
