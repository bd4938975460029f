"""The FSDP trainer (``trainer=fsdp``, ``lora_mode=peft``): a peft LoRA adapter on an HF model, trained with
the plan's policy-gradient algorithm (the update itself is trainer/policy_trainer.py's).

One process on CPU is the common case. When ``torch.distributed`` is initialised with more than one rank
(gloo on CPU, NCCL on GPU), every decoder layer and then the whole model are wrapped with FSDP2
``fully_shard``; each rank trains on its strided share of every batch and FSDP averages the gradients.
The adapter and checkpoint exports gather full tensors (collectives: call them on every rank).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

from miles_runner.models.moe_routing import routing_layout
from miles_runner.trainer import lora_model
from miles_runner.trainer.distributed import rank_and_world
from miles_runner.trainer.policy_trainer import PolicyTrainer, TrainerSettings


class FSDPTrainer(PolicyTrainer):
    def __init__(self, model_path: str | Path, settings: TrainerSettings) -> None:
        from transformers import AutoTokenizer

        self.model_path = str(model_path)
        model = lora_model.load_lora_model(self.model_path, settings.adapter, seed=settings.seed)
        routing = routing_layout(model) if settings.routing_replay else None
        if settings.recompute:
            lora_model.enable_recompute(model)
        if rank_and_world()[1] > 1:
            _shard(model)
        pad_id = AutoTokenizer.from_pretrained(self.model_path).pad_token_id or 0
        super().__init__(settings, model, pad_id=pad_id, routing=routing)

    # ---- the model and its adapter ----

    def _lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _adapter_enabled(self, on: bool) -> AbstractContextManager[Any]:
        return nullcontext() if on else self.model.disable_adapter()

    def _complete_grads(self) -> float:
        # FSDP averaged the gradients over the ranks in the backward; the norm is over the whole (sharded) adapter.
        return float(torch.nn.utils.clip_grad_norm_(self._lora_parameters(), self.settings.optimizer.clip_grad))

    def _write_adapter(self, folder: Path) -> None:
        state = self.adapter_state()
        if self.rank == 0:
            self.model.save_pretrained(folder, state_dict=state)

    # ---- export and checkpoints ----

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors in PEFT naming (what engines load); collective under FSDP2."""
        return lora_model.peft_adapter_state(self.model)

    def adapter_views(self) -> dict[str, torch.Tensor] | None:
        """The adapter's tensors sharing the parameters' memory (valid until the next train step); None under FSDP,
        where each rank holds shards."""
        return lora_model.peft_adapter_views(self.model) if self.world_size == 1 else None

    def move_adapter(self, homes: dict[str, torch.Tensor]) -> None:
        """Move the adapter's parameters into `homes` (shared memory an engine reads them from: TensorSync.share)."""
        lora_model.move_adapter(self.model, homes)

    def adapter_config(self) -> dict[str, Any]:
        return lora_model.adapter_config_dict(self.settings.adapter)

    def state_dict(self) -> dict[str, Any]:
        """Adapter, optimizer, RNG and step, as full tensors (collective under FSDP2; complete on rank 0)."""
        self._resident()  # the optimizer state may be offloaded
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            "adapter": lora_model.trainable_state(self.model),
            # A copy: on CPU the returned tensors may alias the live optimizer state, which later steps mutate.
            "optimizer": copy.deepcopy(get_optimizer_state_dict(self.model, self.optimizer, options=options)),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resident()  # the optimizer state may be offloaded
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=self.world_size > 1)
        result = set_model_state_dict(self.model, state["adapter"], options=options)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if missing := trainable & set(result.missing_keys):
            raise ValueError(f"checkpoint lacks adapter tensors: {sorted(missing)[:4]}")
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=options)
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in lora_model.decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
