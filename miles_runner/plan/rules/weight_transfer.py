"""Which weight-transfer modes suit LoRA and colocated engines (docs/system.md §1.2 rules 16-17)."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import ADAPTERS, TOPOLOGY, Finding, rule


@rule("lora-sync-needs-broadcast")
def lora_sync_needs_broadcast(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode = cfg.weight_sync.transfer_mode
    if d.lora_enabled and mode in ("p2p", "disk-delta"):
        yield Finding(
            ("weight_sync.transfer_mode", ADAPTERS),
            f"LoRA weight sync is not implemented for {mode}: adapters go by tensor handoff or broadcast.",
            "weight_sync.transfer_mode=broadcast",
        )


@rule("transfer-mode-needs-disaggregated")
def transfer_mode_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode = cfg.weight_sync.transfer_mode
    if d.colocated and mode in ("p2p", "disk-delta"):
        yield Finding(
            ("weight_sync.transfer_mode", TOPOLOGY),
            f"{mode} transfers weights to engines on other GPUs; colocated engines share the trainer's.",
            "weight_sync.transfer_mode=broadcast",
        )
