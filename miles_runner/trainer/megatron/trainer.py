"""The Megatron trainer (``trainer=megatron``): a megatron-core GPT/MoE model built from the HF checkpoint, the
plan's LoRA on it (``lora_mode=raw``: the project's own LoRA on megatron's parallel linears), trained by the same
policy update as the FSDP trainer (trainer/policy_trainer.py).

Ranks follow Megatron's layout: ``world = TP x PP x CP x DP``; the ranks of one TP group see the same samples
(each DP rank its strided share of every batch, as FSDP's ranks do), expert weights are split over EP. Every
rank runs the same number of forwards with the same shapes (the MoE token dispatcher gathers across ranks), so
micro-batch counts and widths are agreed over the whole world first (trainer/micro_batches.py).

Checkpoints hold the adapter in PEFT names (layout-free), each rank's optimizer state (resume needs the same
layout, as in Megatron) and the step; the adapter export is the same tensors whatever the layout.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.plan.model import Plan
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.convert import load_hf_checkpoint
from miles_runner.trainer.megatron.model import build_model, routing_layout
from miles_runner.trainer.megatron.packing import CausalLMForLoss
from miles_runner.trainer.policy_trainer import DataParallel, PolicyTrainer, TrainerSettings


class MegatronTrainer(PolicyTrainer):
    """One rank of the Megatron trainer; every rank makes every call (trainer/ranks.py replays rank 0's)."""

    ranks_name = "data-parallel ranks"

    def __init__(
        self,
        model_path: str | Path,
        settings: TrainerSettings,
        layout: parallel.Layout,
        *,
        qkv_format: str = "thd",
        device: torch.device | None = None,
    ) -> None:
        parallel.initialize(layout)
        self.layout, self.model_path = layout, str(model_path)
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        model = self._build_model(hf_config, settings)
        model.to(device or torch.device("cpu"))
        super().__init__(settings, model, **trainer_parts(model, hf_config, settings.routing_replay, qkv_format))
        if settings.adapter.init_path:
            self.load_adapter_folder(Path(settings.adapter.init_path))

    # ---- the model and its LoRA (lora_mode=raw here; bridge.BridgeTrainer overrides these for Megatron-Bridge) ----

    def _build_model(self, hf_config: dict, settings: TrainerSettings) -> torch.nn.Module:
        """The megatron model with the HF weights, frozen, and the plan's LoRA attached."""
        s = settings
        model = frozen_model(
            self.model_path, hf_config, self.layout, routing_replay=s.routing_replay, recompute=s.recompute
        )
        raw_lora.attach_lora(model, s.adapter, seed=s.seed)
        return model

    def _lora_parameters(self) -> list[torch.nn.Parameter]:
        return raw_lora.lora_parameters(self.model)

    def _adapter_enabled(self, on: bool) -> AbstractContextManager[Any]:
        return raw_lora.enabled(self.model, on)

    def _complete_grads(self) -> float:
        raw_lora.reduce_lora_grads(self.model)
        return raw_lora.clip_grad_norm(self.model, self.settings.optimizer.clip_grad)

    def _load_peft_state(self, state: dict[str, torch.Tensor]) -> None:
        lora_export.load_peft_state(self.model, state)

    def _write_adapter(self, folder: Path) -> None:
        from safetensors.torch import save_file

        state = self.adapter_state()
        if self.rank == 0:
            save_file({k: v.contiguous() for k, v in state.items()}, folder / "adapter_model.safetensors")
            config = {**self.adapter_config(), "base_model_name_or_path": self.model_path}
            (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")

    # ---- export and checkpoints ----

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors in PEFT naming (what engines load), the same whatever the layout; collective."""
        return lora_export.export_peft_state(self.model)

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT config of `adapter_state` (expert LoRA as peft's target_parameters)."""
        return lora_export.peft_adapter_config(self.model, self.settings.adapter)

    def load_adapter_folder(self, folder: Path) -> None:
        """Start from a saved PEFT adapter (adapters.path): every LoRA tensor is replaced, or it fails."""
        from safetensors.torch import load_file

        self._load_peft_state(load_file(folder / "adapter_model.safetensors"))

    def state_dict(self) -> dict[str, Any]:
        """Every rank's LoRA shards and optimizer state (resume needs the same layout, as in Megatron), the adapter
        in PEFT names (layout-free, to read), RNG and step; collective, complete on every rank."""
        self._resident()  # the optimizer state may be offloaded
        return {
            "adapter": self.adapter_state(),
            "lora_by_rank": gathered(self._lora_shards()),
            "optimizer_by_rank": gathered(self.optimizer.state_dict()),
            "layout": self._layout_record(),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def _lora_shards(self) -> dict[str, torch.Tensor]:
        """This rank's trainable (LoRA) parameters under the model's own names."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def _layout_record(self) -> dict[str, Any]:
        return parallel.layout_record(self.layout)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resident()  # the optimizer state may be offloaded
        saved = state.get("layout")
        if saved != self._layout_record():
            raise ValueError(
                f"the checkpoint was written with trainer layout {saved}; this run is "
                f"{self._layout_record()}: resume with the same TP/EP/PP and rank count"
            )
        shards, params = state["lora_by_rank"][self.rank], dict(self.model.named_parameters())
        if set(shards) != {name for name, p in params.items() if p.requires_grad}:
            raise ValueError(f"the checkpoint's LoRA tensors {sorted(shards)[:3]}... are not this model's adapter")
        with torch.no_grad():
            for name, tensor in shards.items():
                params[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer_by_rank"][self.rank])
        torch.set_rng_state(state["rng"])
        self.step = int(state["step"])


def trainer_parts(model: torch.nn.Module, hf_config: dict, routing_replay: bool, qkv_format: str) -> dict[str, Any]:
    """What a Megatron trainer gives its base class besides the model (PolicyTrainer and SlotTrainer take the same):
    the packing wrapper the loss calls, the pad id, the routing layout under R3, the data-parallel ranks."""
    return {
        "net": CausalLMForLoss(model, qkv_format=qkv_format),
        "pad_id": int(hf_config.get("pad_token_id") or 0),
        "routing": routing_layout(model) if routing_replay else None,
        "dp": DataParallel(
            parallel.data_parallel_rank(), parallel.data_parallel_size(), parallel.data_parallel_group()
        ),
    }


def frozen_model(
    model_path: str, hf_config: dict, layout: parallel.Layout, *, routing_replay: bool, recompute: bool
) -> torch.nn.Module:
    """The megatron model of the HF checkpoint at `model_path`, every parameter frozen."""
    model = build_model(hf_config, layout, routing_replay=routing_replay, recompute=recompute)
    load_hf_checkpoint(model, model_path)
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def gathered(local: Any) -> list[Any]:
    """`local` of every rank, in rank order (collective)."""
    every_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, local)
    return every_rank


def build_megatron_trainer(plan: Plan, trainer_class: type[MegatronTrainer] = MegatronTrainer) -> MegatronTrainer:
    """This rank's Megatron trainer for the plan: MegatronTrainer (``lora_mode=raw``) or a subclass of it
    (``lora_mode=bridge``: bridge.BridgeTrainer, which trainer/ranks.py passes; bridge.py imports this module)."""
    settings, layout = TrainerSettings.from_plan(plan), parallel.Layout.from_plan(plan)
    options = {"qkv_format": plan.trainer.parallel.qkv_format, "device": trainer_device(plan)}
    return trainer_class(plan.model_path, settings, layout, **options)


def trainer_device(plan: Plan) -> torch.device:
    """The host CPU on a cpu-only cluster; else the GPU of this rank's placement device (made current: megatron
    allocates its buffers on the current device)."""
    if plan.cluster.cpu_only:
        return torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    _, device = plan.trainer.placements[rank]
    torch.cuda.set_device(device)
    return torch.device("cuda", device)
