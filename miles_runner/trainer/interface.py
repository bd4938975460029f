"""What the loops may ask of a trainer: `Trainer` trains one adapter, `MultiLoRATrainer` one adapter per engine slot.

The loops, the checkpoints and the pushes are written against these Protocols, never a concrete class, so that any
backend serves them: `Trainer` is implemented by the FSDP trainer (fsdp.py), the Megatron trainer with
``lora_mode=raw`` and ``bridge`` (megatron/trainer.py, megatron/bridge.py) and rank 0's proxy of several ranks
(ranks.py: `RankedTrainer`); `MultiLoRATrainer` by the peft multi-LoRA trainer (multi_lora.py) and its proxy
(`RankedMultiLoRATrainer`). tests/trainer/test_interface.py holds every one to its Protocol.

Calls that touch the model are collective under several ranks: every rank makes them, in the same order (ranks.py
replays rank 0's), so their arguments must be the same on every rank.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from miles_runner.core.adapters import AdapterSpec
from miles_runner.trainer.logprobs import TrainingSample


class Trainer(Protocol):
    """One LoRA adapter on a frozen base model, trained with the plan's policy loss."""

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One rollout's update (samples group by group, the same full list on every rank); the step's metrics."""

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        """The log-probs of each sample's response tokens, with the adapter or (False) without it."""

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        """The adapter's raw logprobs of the push probe (weight_sync/probe.py)."""

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors in PEFT naming: what the engines load."""

    def adapter_views(self) -> dict[str, torch.Tensor] | None:
        """`adapter_state` as views of the parameters themselves (valid until the next step), or None where the
        exported tensors are copies (converted names, shards)."""

    def move_adapter(self, homes: dict[str, torch.Tensor]) -> None:
        """Move the adapter's parameters into `homes` (memory an engine reads them from); only after
        `adapter_views` gave views."""

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT config of `adapter_state`."""

    def save_adapter(self, out_dir: str | Path) -> Path:
        """A PEFT folder (adapter_config.json + adapter_model.safetensors), replaced whole."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds: adapter, optimizer, RNG and step."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict`."""

    def offload_state(self) -> dict[str, Any]:
        """Move the frozen weights, gradients and optimizer state out while the engines work (topology.offload_train;
        nothing without it); what moved, and the resident memory after."""

    def onload_state(self) -> dict[str, Any]:
        """Bring them back (a call that needs them does it first, too)."""


class MultiLoRATrainer(Protocol):
    """One LoRA adapter per engine slot on one frozen base model: slots are loaded and cleared as tenants come and
    go, gradients are kept across train calls, and only the slots whose batch is complete step."""

    def load_adapter(self, slot: int, adapter: AdapterSpec, state: dict[str, Any] | None = None) -> None:
        """Install a fresh adapter and optimizer in `slot`, or the saved `state` (a `state_dict`) of one."""

    def clear_adapter(self, slot: int) -> None:
        """Drop the slot's adapter, its kept gradients and its optimizer state."""

    def train(self, samples: Sequence[TrainingSample], step_slots: Collection[int]) -> dict[int, dict[str, float]]:
        """Accumulate each sample's gradients into its slot (``metadata["slot"]``), then step `step_slots`;
        metrics by slot."""

    def probe_log_probs(self, token_ids: Sequence[int], slot: int) -> list[float]:
        """The slot's adapter's raw logprobs of the push probe (weight_sync/probe.py)."""

    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's adapter tensors in PEFT naming (what the engines load under the slot's name)."""

    def adapter_config(self, slot: int) -> dict[str, Any]:
        """The PEFT config of the slot's `adapter_state`."""

    def adapter_step(self, slot: int) -> int:
        """The steps the slot's adapter has taken (counted on from its checkpoint when resumed)."""

    def state_dict(self, slot: int) -> dict[str, Any]:
        """What the slot's adapter checkpoint holds: adapter, optimizer and step."""
