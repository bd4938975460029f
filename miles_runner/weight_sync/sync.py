"""Adapter sync into the engines: `make_sync` picks the plan's strategy (docs/system.md §3.2 and §7).

    pause_generation(mode) -> flush_cache (colocated: always; disaggregated: unless in_place) -> push
    -> update_weight_version -> continue_generation (always, even when the push failed)

Colocated engines receive the adapter tensors in the request (tensor_sync.py); disaggregated engines receive
them by a torch.distributed broadcast (broadcast.py). The shared protocol is in adapter_sync.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from miles_runner.plan.model import Plan
from miles_runner.procs.ports import LOOPBACK
from miles_runner.sglang_client.client import EngineClient
from miles_runner.weight_sync.adapter_sync import AdapterSync
from miles_runner.weight_sync.broadcast import BroadcastSync
from miles_runner.weight_sync.tensor_sync import TensorSync


def make_sync(
    plan: Plan, clients: Sequence[EngineClient], lora_name: str | None = None, *, trainer_address: str = LOOPBACK
) -> AdapterSync:
    """The plan's strategy; `lora_name` is the adapter a push updates unless the push names another.
    `trainer_address` is where the engines reach this process (the broadcast group's store listens there)."""
    if plan.weight_sync.transfer_mode == "tensor":
        return TensorSync(clients, plan, lora_name)
    if plan.weight_sync.transfer_mode == "broadcast":
        # Requests paused in place still hold the adapter, so an unload would wait for them forever: upsert.
        upsert = plan.weight_sync.pause_generation_mode == "in_place" or plan.capabilities.multi_lora
        return BroadcastSync(clients, plan, lora_name, upsert=upsert, master_address=trainer_address)
    raise ValueError(f"adapter sync has no {plan.weight_sync.transfer_mode!r} method (the plan compiler rejects it)")


def share_trainer_adapter(trainer: Any, sync: AdapterSync) -> bool:
    """Move the trainer's adapter parameters into the memory a tensor sync hands engines on this host (one copy a
    push, the engine's own, as CUDA IPC gives SGLang on GPUs); True when they moved, and then `adapter_views()` is
    what a push sends. False, with nothing moved, for a trainer that exports copies (FSDP shards, Megatron's
    converted names), a broadcast sync, or engines that do not read shared memory."""
    views = trainer.adapter_views() if hasattr(trainer, "adapter_views") else None
    if views is None or not isinstance(sync, TensorSync):
        return False
    homes = sync.share(views)
    if homes is None:
        return False
    trainer.move_adapter(homes)
    return True
