"""The Megatron trainer (``trainer=megatron``): a megatron-core GPT/MoE model built from the HF checkpoint, the
plan's LoRA on it (``lora_mode=raw``: the project's own LoRA on megatron's parallel linears), trained with the
same policy loss, advantages, micro-batching and metrics as the FSDP trainer (trainer/policy_grads.py).

Ranks follow Megatron's layout: ``world = TP x PP x CP x DP``; the ranks of one TP group see the same samples
(each DP rank its strided share of every batch, as FSDP's ranks do), expert weights are split over EP. Every
rank runs the same number of forwards with the same shapes (the MoE token dispatcher gathers across ranks), so
micro-batch counts and widths are agreed over the whole world first (trainer/megatron/batches.py).

Checkpoints hold the adapter in PEFT names (layout-free), each rank's optimizer state (resume needs the same
layout, as in Megatron) and the step; the adapter export is the same tensors whatever the layout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.plan.model import Plan
from miles_runner.trainer.fsdp import FSDPTrainer, TrainerSettings
from miles_runner.trainer.logprobs import TokenBatch, TrainingSample, pack_samples, response_values, sequence_log_probs
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.cpu_compat import apply_cpu_adaptations
from miles_runner.trainer.megatron.model import build_model, routing_layout
from miles_runner.trainer.megatron.packing import CausalLMForLoss
from miles_runner.trainer.metrics import MetricMeans
from miles_runner.trainer.micro_batches import agreed_micro_batches, cut_columns, row_lengths
from miles_runner.trainer.policy_grads import accumulate_policy_gradients, build_optimizer
from miles_runner.trainer.routing_replay import check_routed_experts


class MegatronTrainer:
    """One rank of the Megatron trainer; every rank makes every call (trainer/ranks.py replays rank 0's)."""

    def __init__(
        self,
        model_path: str | Path,
        settings: TrainerSettings,
        layout: parallel.Layout,
        *,
        qkv_format: str = "thd",
        device: torch.device | None = None,
    ) -> None:
        apply_cpu_adaptations()
        parallel.initialize(layout)
        self.settings, self.layout, self.model_path = settings, layout, str(model_path)
        hf_config = json.loads((Path(model_path) / "config.json").read_text())
        self.model = self._build_model(hf_config)
        self.model.to(device or torch.device("cpu"))
        if settings.adapter.init_path:
            self.load_adapter_folder(Path(settings.adapter.init_path))
        self.net = CausalLMForLoss(self.model, qkv_format=qkv_format)
        self.routing = routing_layout(self.model) if settings.routing_replay else None
        self.pad_id = int(hf_config.get("pad_token_id") or 0)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dp_rank, self.dp_size = parallel.data_parallel_rank(), parallel.data_parallel_size()
        self.optimizer = build_optimizer(self._lora_parameters(), settings.optimizer, settings.adapter.lr)
        self.step = 0
        self.estimator = settings.estimator()
        self.loss_config = settings.loss_config()

    # ---- the model and its LoRA (lora_mode=raw here; bridge.BridgeTrainer overrides these for Megatron-Bridge) ----

    def _build_model(self, hf_config: dict) -> torch.nn.Module:
        """The megatron model with the HF weights, frozen, and the plan's LoRA attached."""
        from miles_runner.trainer.megatron.convert import load_hf_checkpoint

        s = self.settings
        model = build_model(hf_config, self.layout, routing_replay=s.routing_replay, recompute=s.recompute)
        load_hf_checkpoint(model, self.model_path)
        for param in model.parameters():
            param.requires_grad_(False)
        raw_lora.attach_lora(model, s.adapter, seed=s.seed)
        return model

    def _lora_parameters(self) -> list[torch.nn.Parameter]:
        return raw_lora.lora_parameters(self.model)

    def _adapter_enabled(self, on: bool):
        """A context in which the adapter applies (on) or not (the base policy, the KL reference)."""
        return raw_lora.enabled(self.model, on)

    def _complete_grads(self) -> float:
        """Reduce the LoRA gradients over the ranks and clip them; the gradient norm before clipping."""
        raw_lora.reduce_lora_grads(self.model)
        return raw_lora.clip_grad_norm(self.model, self.settings.optimizer.clip_grad)

    def _load_peft_state(self, state: dict[str, torch.Tensor]) -> None:
        lora_export.load_peft_state(self.model, state)

    # ---- log-probs ----

    def _local(self, items: Sequence[Any]) -> list[Any]:
        return list(items[self.dp_rank :: self.dp_size])

    def _micro_batches(self, batch: TokenBatch, rows: list[int]) -> list[list[int]]:
        every_row = row_lengths(batch)
        return agreed_micro_batches(
            [every_row[r] for r in rows],
            size=self.settings.micro_batch_size,
            max_tokens=self.settings.max_tokens_per_micro_batch,
            world_size=self.world_size,
        )

    @torch.no_grad()
    def _log_probs(self, batch: TokenBatch, *, adapter: bool = True) -> torch.Tensor:
        from miles_runner.trainer.logprobs import token_log_probs

        self.model.eval()
        out = torch.zeros(batch.loss_mask.shape)
        cut = self.settings.max_tokens_per_micro_batch > 0
        with self._adapter_enabled(adapter):
            for rows in self._micro_batches(batch, list(range(batch.input_ids.shape[0]))):
                part = batch.select(torch.tensor(rows, dtype=torch.long))
                width = max(row_lengths(part), default=1) if cut else part.input_ids.shape[1]
                part = cut_columns(part, width)
                log_probs, _ = token_log_probs(self.net, part, temperature=self.settings.temperature)
                if rows:
                    out[rows, : width - 1] = log_probs
        return out

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        """The trainer's log-probs of each sample's response tokens (every rank computes all of them)."""
        batch = pack_samples(samples, self.pad_id, self.routing)
        return response_values(self._log_probs(batch, adapter=adapter), samples)

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        """The adapter's raw logprobs of the push probe (weight_sync/probe.py); collective."""
        self.model.eval()
        return sequence_log_probs(self.net, token_ids)

    # ---- training ----

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One rollout's update. Samples are ordered group by group; every rank passes the same full list."""
        s = self.settings
        check_routed_experts(samples, self.routing)
        rewards = torch.tensor([float(x.reward if x.reward is not None else 0.0) for x in samples])
        gbs = s.global_batch_size or len(samples)
        if len(samples) % gbs or gbs % self.dp_size:
            raise ValueError(
                f"{len(samples)} samples, global batch {gbs} and {self.dp_size} data-parallel ranks do not divide"
            )
        means = MetricMeans()
        step_chunks = [range(i, i + gbs) for i in range(0, len(samples), gbs)]
        local_all = self._local(range(len(samples)))
        full = pack_samples([samples[i] for i in local_all], self.pad_id, self.routing)
        old = self._old_log_probs(full, single_step=len(step_chunks) == 1)
        ref = self._log_probs(full, adapter=False) if s.algorithm.kl_coef > 0 else None
        reduce = functools.partial(dist.all_reduce, group=parallel.data_parallel_group()) if self.dp_size > 1 else None
        advantages = self.estimator.advantages(
            rewards, local_all, full.loss_mask, full.attention_mask[:, 1:], self._reward_kl(full, old, ref), reduce
        )
        for chunk in step_chunks:
            rows = [local_all.index(i) for i in self._local(chunk)]
            self._optimizer_step(full, rows, advantages[rows], old, ref, means)
        metrics = means.result()
        metrics["loss"] /= len(step_chunks)
        metrics.update(reward_mean=float(rewards.mean()), step=float(self.step), lr=s.adapter.lr)
        return metrics

    # The old policy and the KL in the reward are the FSDP trainer's, over this trainer's _log_probs.
    _old_log_probs = FSDPTrainer._old_log_probs
    _reward_kl = FSDPTrainer._reward_kl

    def _optimizer_step(
        self,
        full: TokenBatch,
        rows: list[int],
        advantages: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        means: MetricMeans,
    ) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        accumulate_policy_gradients(
            self.net,
            full,
            rows,
            advantages,
            old,
            ref,
            self.loss_config,
            means,
            temperature=self.settings.temperature,
            micro_batches=self._micro_batches(full, rows),
            normalizer=self._normalizer(full, rows),
            cut=self.settings.max_tokens_per_micro_batch > 0,
        )
        grad_norm = self._complete_grads()
        self.optimizer.step()
        self.step += 1
        means.add({"grad_norm": float(grad_norm)}, 1.0)

    def _normalizer(self, full: TokenBatch, rows: list[int]) -> float:
        if not self.loss_config.per_token_loss:
            return float(len(rows))
        # Gradients are averaged over DP ranks: each divides by the step's tokens over all DP ranks / DP size.
        tokens = full.loss_mask[torch.tensor(rows, dtype=torch.long)].sum() if rows else torch.tensor(0.0)
        if self.dp_size > 1:
            dist.all_reduce(tokens, group=parallel.data_parallel_group())
        return float(tokens.clamp(min=1)) / self.dp_size

    # ---- export and checkpoints ----

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter tensors in PEFT naming (what engines load), the same whatever the layout; collective."""
        return lora_export.export_peft_state(self.model)

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT config of `adapter_state` (expert LoRA as peft's target_parameters)."""
        return lora_export.peft_adapter_config(self.model, self.settings.adapter)

    def save_adapter(self, out_dir: str | Path) -> Path:
        """A PEFT folder (adapter_config.json + adapter_model.safetensors), written atomically by rank 0."""
        from safetensors.torch import save_file

        state, out = self.adapter_state(), Path(out_dir)
        if self.rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
            save_file({k: v.contiguous() for k, v in state.items()}, staging / "adapter_model.safetensors")
            config = {**self.adapter_config(), "base_model_name_or_path": self.model_path}
            (staging / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
        if self.world_size > 1:
            dist.barrier()
        return out

    def load_adapter_folder(self, folder: Path) -> None:
        """Start from a saved PEFT adapter (adapters.path): every LoRA tensor is replaced, or it fails."""
        from safetensors.torch import load_file

        self._load_peft_state(load_file(folder / "adapter_model.safetensors"))

    def state_dict(self) -> dict[str, Any]:
        """Every rank's LoRA shards and optimizer state (resume needs the same layout, as in Megatron), the adapter
        in PEFT names (layout-free, to read), RNG and step; collective, complete on every rank."""
        return {
            "adapter": self.adapter_state(),
            "lora_by_rank": self._gathered(self._lora_shards()),
            "optimizer_by_rank": self._gathered(self.optimizer.state_dict()),
            "layout": self._layout_record(),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def _gathered(self, local: Any) -> list[Any]:
        every_rank: list[Any] = [None] * self.world_size
        dist.all_gather_object(every_rank, local)
        return every_rank

    def _lora_shards(self) -> dict[str, torch.Tensor]:
        """This rank's trainable (LoRA) parameters under the model's own names."""
        return {name: p.detach().cpu().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def _layout_record(self) -> dict[str, Any]:
        """What the optimizer shards depend on: the model-parallel layout and the rank count."""
        return {**dataclasses.asdict(self.layout), "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
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
