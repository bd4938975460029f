"""Megatron multi-LoRA (``trainer=megatron adapters=multi``): one raw LoRA per engine slot on one frozen megatron
model (raw_lora.attach_slot), each slot with its own rank, alpha, targets and optimizer, trained by the update
every multi-LoRA trainer shares (trainer/multi_lora.py: `SlotTrainer`).

A forward applies one slot's LoRA (its samples are packed alone), so the other slots' parameters get no gradient
and their kept gradients stay apart; R3 replays inside each slot's forward and backward as in the one-adapter
trainer. Megatron-Bridge's MultiLoRA (what miles uses) runs every slot in one forward with per-slot token spans
and grouped GEMMs; it is not in the pinned Megatron-Bridge release, and per-slot forwards give the same gradients.

Ranks follow the one-adapter Megatron trainer (megatron/trainer.py): a slot's samples are split over the
data-parallel ranks, strided, and every rank of the world runs as many forwards (the MoE dispatcher and the TP
collectives pair them up), so a slot's sample count in one train call must divide by the data-parallel size: the
loop hands the trainer whole data-parallel splits of groups (the plan's adapter-batch-shape, as in miles). A step
completes the slot's gradients as raw_lora does for one adapter (TP partial sums, then the data-parallel mean) and
turns the mean into the sum over the ranks times 1/adapter_global_batch_size.

A slot's checkpoint holds its adapter in PEFT names (to read), every rank's LoRA shards and optimizer state (a
resume needs the same layout, as in Megatron) and its step.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.core.adapters import AdapterSpec
from miles_runner.plan.model import Plan
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.trainer import frozen_model, gathered, trainer_device, trainer_parts
from miles_runner.trainer.micro_batches import agreed_micro_batches, row_lengths
from miles_runner.trainer.multi_lora import MultiLoRASettings, SlotTrainer, _Slot


class MegatronMultiLoRATrainer(SlotTrainer):
    """One rank of the Megatron multi-LoRA trainer; every rank makes every call (trainer/ranks.py)."""

    def __init__(
        self,
        model_path: str | Path,
        settings: MultiLoRASettings,
        layout: parallel.Layout,
        *,
        qkv_format: str = "thd",
        device: torch.device | None = None,
    ) -> None:
        parallel.initialize(layout)
        self.layout, self.model_path = layout, str(model_path)
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        model = self._build_model(hf_config, settings)
        self.device = device or torch.device("cpu")
        model.to(self.device)
        super().__init__(settings, model, **trainer_parts(model, hf_config, settings.routing_replay, qkv_format))

    def _build_model(self, hf_config: dict, settings: MultiLoRASettings) -> torch.nn.Module:
        """The frozen megatron model the slots go on (bridge.BridgeMultiLoRATrainer: Bridge's)."""
        s = settings
        return frozen_model(
            self.model_path, hf_config, self.layout, routing_replay=s.routing_replay, recompute=s.recompute
        )

    # ---- slots ----

    def _install(self, slot: int, adapter: AdapterSpec) -> list[torch.nn.Parameter]:
        loras = raw_lora.attach_slot(self.model, slot, adapter, seed=self.settings.seed + slot)
        for lora in loras:
            lora.to(self.device)
        return [p for lora in loras for p in (lora.lora_A, lora.lora_B)]

    def _uninstall(self, slot: int, entry: _Slot) -> None:
        raw_lora.clear_slot(self.model, slot)

    def _active(self, slot: int) -> AbstractContextManager[Any]:
        return raw_lora.slot_active(self.model, slot)

    def _adapter_off(self) -> AbstractContextManager[Any]:
        return raw_lora.disabled(self.model)

    def _micro_batches(self, full: Any, rows: list[int]) -> list[list[int]]:
        """As many micro-batches on every rank (equal shares: `_backward` checks them)."""
        every_row = row_lengths(full)
        return agreed_micro_batches(
            [every_row[r] for r in rows],
            size=self.settings.micro_batch_size,
            max_tokens=self.settings.max_tokens_per_micro_batch,
            world_size=dist.get_world_size(),
        )

    def _backward(self, slot: int, samples: list[Any]) -> dict[str, float]:
        if len(samples) % self.dp.size:
            raise ValueError(
                f"{len(samples)} samples of adapter {self.slots[slot].adapter.name} do not split over "
                f"{self.dp.size} data-parallel ranks: every rank must run as many forwards (the loop passes whole "
                "data-parallel splits of groups)"
            )
        return super()._backward(slot, samples)

    def _complete_grads(self, slot: int, scale: float) -> float:
        with raw_lora.slot_active(self.model, slot):
            raw_lora.reduce_lora_grads(self.model)  # the data-parallel mean: times dp.size is the sum
            for param in self.slots[slot].params:
                param.grad.mul_(scale * self.dp.size)  # reduce_lora_grads gave every parameter a gradient
            return raw_lora.clip_grad_norm(self.model, self.settings.optimizer.clip_grad)

    # ---- export and checkpoints ----

    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's adapter in PEFT names, the same whatever the layout; collective."""
        with raw_lora.slot_active(self.model, slot):
            return lora_export.export_peft_state(self.model)

    def adapter_config(self, slot: int) -> dict[str, Any]:
        with raw_lora.slot_active(self.model, slot):
            return lora_export.peft_adapter_config(self.model, self.slots[slot].adapter)

    def state_dict(self, slot: int) -> dict[str, Any]:
        """The slot's adapter (PEFT names), every rank's LoRA shards and optimizer state, the layout and the step;
        collective, complete on every rank."""
        entry = self.slots[slot]
        return {
            "adapter": self.adapter_state(slot),
            "lora_by_rank": gathered([p.detach().cpu().clone() for p in entry.params]),
            "optimizer_by_rank": gathered(entry.optimizer.state_dict()),
            "layout": self._layout_record(),
            "step": entry.step,
        }

    def _layout_record(self) -> dict[str, Any]:
        return parallel.layout_record(self.layout)

    def _load_slot_state(self, slot: int, entry: _Slot, state: dict[str, Any]) -> None:
        if state.get("layout") != self._layout_record():
            raise ValueError(
                f"the checkpoint of adapter {entry.adapter.name} was written with trainer layout "
                f"{state.get('layout')}; this run is {self._layout_record()}: resume with the same TP/EP and ranks"
            )
        rank = dist.get_rank()
        mine = {**state, "adapter": state["lora_by_rank"][rank], "optimizer": state["optimizer_by_rank"][rank]}
        super()._load_slot_state(slot, entry, mine)


def build_megatron_multi_lora_trainer(
    plan: Plan, trainer_class: type[MegatronMultiLoRATrainer] = MegatronMultiLoRATrainer
) -> MegatronMultiLoRATrainer:
    """This rank's Megatron multi-LoRA trainer for the plan: raw (MegatronMultiLoRATrainer) or Bridge's model
    (bridge.BridgeMultiLoRATrainer, which trainer/ranks.py passes)."""
    return trainer_class(
        plan.model_path,
        MultiLoRASettings.from_plan(plan),
        parallel.Layout.from_plan(plan),
        qkv_format=plan.trainer.parallel.qkv_format,
        device=trainer_device(plan),
    )
