"""SGLang's weight-update process group, from either end: the trainer (rank 0, the source of every broadcast)
and the engines (ranks ``rank_offset ...``, receivers).

The group is built the way SGLang's ``init_custom_process_group`` builds it (TCP rendezvous on
``master_address:master_port``, a store prefixed by ``group_name``, a group that is *not* the default one), so
a trainer that uses this module can talk to a real SGLang engine as well as to the embedded one, and the
trainer's own default group (FSDP) stays untouched. Every member must call :func:`init_weight_update_group`
before any of them returns: the call blocks until all ``world_size`` ranks have joined, or ``timeout_s``.

The same timeout bounds every collective: gloo cannot abort a broadcast whose peer never comes, so a failed
broadcast returns after ``timeout_s``, and the group is then out of step (its tag counters differ between
ranks) and must be destroyed and built again.

The store's server (on rank 0) listens on ``master_address:master_port`` only: loopback when trainer and engines
share a node, the trainer node's own address across nodes (the engines connect there; never every interface, as
torch's own rendezvous would). The store has no authentication: anyone who can reach that address and port can
join or disturb the group while it is being built (SECURITY.md).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def init_weight_update_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    timeout_s: float,
) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = bound_store(master_address, master_port, world_size, timeout)
    else:
        url = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        PrefixStore(group_name, store),
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # as SGLang registers it
    return group


def bound_store(address: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0's store server, listening on `address` only: torch's rendezvous binds every interface, but its
    TCPStore takes a socket that is already listening (`master_listen_fd`), which we bind ourselves."""
    listener = socket.create_server((address, port), backlog=socket.SOMAXCONN)
    try:
        return dist.TCPStore(
            address,
            port,
            world_size,
            is_master=True,
            timeout=timeout,
            master_listen_fd=listener.fileno(),
            use_libuv=True,
        )
    finally:
        listener.close()  # the store holds its own duplicate of the socket


def destroy_weight_update_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a dtype, as SGLang takes it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; give a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def broadcast_tensors(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Send every tensor from rank 0, in order (each must be contiguous); return once all have arrived.

    The same collectives, one per tensor in order, whichever way they are issued. NCCL queues them all at once
    (as SGLang's receiver does). Gloo runs them one at a time: with several in flight, its TCP loop thread
    spins on `epoll_wait` while a worker thread holds the connection's lock (`Pair::handleEvents` only
    try-locks), and on a 2-core machine the spinner starves the holder. One at a time, an engine receives an
    adapter faster (bench/adapter_sync_bandwidth.py measures the broadcast).
    """
    if dist.get_backend(group) == dist.Backend.GLOO:
        for tensor in tensors:
            dist.broadcast(tensor, group=group, group_src=0)
        return
    handles = [dist.broadcast(tensor, group=group, group_src=0, async_op=True) for tensor in tensors]
    for handle in handles:
        handle.wait()


def receive_tensors(
    dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], group: dist.ProcessGroup, device: str = "cpu"
) -> list[torch.Tensor]:
    """Receive, in order, the tensors that rank 0 sends with :func:`broadcast_tensors`."""
    pairs = zip(dtypes, shapes, strict=True)
    tensors = [torch.empty(tuple(shape), dtype=dtype, device=device) for dtype, shape in pairs]
    broadcast_tensors(tensors, group)
    return tensors
