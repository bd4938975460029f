"""The FSDP trainer (``trainer=fsdp``, ``lora_mode=peft``): a peft LoRA adapter on an HF model, trained with
the plan's policy-gradient algorithm.

One process on CPU is the common case. When ``torch.distributed`` is initialised with more than one rank
(gloo on CPU, NCCL on GPU), every decoder layer and then the whole model are wrapped with FSDP2
``fully_shard``; each rank trains on its strided share of every batch and FSDP averages the gradients.
The adapter and checkpoint exports gather full tensors (collectives: call them on every rank).

``train(samples)`` is one rollout's update: the plan's advantages (trainer/advantages.py), then one optimizer
step per ``global_batch_size`` samples, each accumulated over micro-batches (trainer/micro_batches.py). Old
log-probs are the rollout's (``algorithm.use_rollout_logprobs``) or the trainer's own before the first step; the
KL reference is the same model with the adapter disabled. With ``routing_replay`` (R3) every forward routes each
token to the experts the rollout chose (trainer/routing_replay.py).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.models.moe_routing import routing_layout
from miles_runner.plan.model import Plan
from miles_runner.trainer import lora_model
from miles_runner.trainer.advantages import Estimator
from miles_runner.trainer.distributed import rank_and_world
from miles_runner.trainer.logprobs import (
    TokenBatch,
    TrainingSample,
    pack_samples,
    response_values,
    sequence_log_probs,
    token_log_probs,
)
from miles_runner.trainer.loss import PolicyLossConfig, k3_kl
from miles_runner.trainer.metrics import MetricMeans
from miles_runner.trainer.micro_batches import agreed_micro_batches, cut_columns, row_lengths
from miles_runner.trainer.policy_grads import accumulate_policy_gradients, build_optimizer, loss_config
from miles_runner.trainer.routing_replay import check_routed_experts


@dataclass(frozen=True)
class TrainerSettings:
    """The Plan slices the trainer reads."""

    adapter: AdapterSpec
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    group_size: int  # samples per prompt: the GRPO group
    global_batch_size: int  # samples per optimizer step
    micro_batch_size: int
    temperature: float = 1.0  # the rollout temperature the engine sampled at
    per_token_loss: bool = False  # trainer.calculate_per_token_loss
    recompute: bool = False  # trainer.parallel.recompute: gradient checkpointing of every decoder layer
    max_tokens_per_micro_batch: int = 0  # trainer.use_dynamic_batch_size: the token budget; 0: micro_batch_size
    routing_replay: bool = False  # R3: train with the rollout's expert choices (rollout.routing_replay)
    seed: int = 0

    @classmethod
    def from_plan(cls, plan: Plan, adapter_index: int = 0) -> TrainerSettings:
        return cls(
            adapter=plan.adapters[adapter_index],
            algorithm=plan.algorithm,
            optimizer=plan.optimizer,
            group_size=plan.batch.n_samples_per_prompt,
            global_batch_size=plan.batch.global_batch_size,
            micro_batch_size=plan.trainer.parallel.micro_batch_size,
            temperature=plan.rollout.temperature,
            per_token_loss=plan.trainer.calculate_per_token_loss,
            recompute=plan.trainer.parallel.recompute,
            max_tokens_per_micro_batch=plan.trainer.max_tokens_per_micro_batch,
            routing_replay=plan.capabilities.use_routing_replay,
            seed=plan.seed,
        )

    def estimator(self) -> Estimator:
        return Estimator.from_algorithm(self.algorithm, self.group_size)

    def loss_config(self) -> PolicyLossConfig:
        return loss_config(self.algorithm, per_token_loss=self.per_token_loss)


class FSDPTrainer:
    def __init__(self, model_path: str | Path, settings: TrainerSettings) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        self.model_path = str(model_path)
        self.rank, self.world_size = rank_and_world()
        self.model = lora_model.load_lora_model(self.model_path, settings.adapter, seed=settings.seed)
        self.routing = routing_layout(self.model) if settings.routing_replay else None
        if settings.recompute:
            lora_model.enable_recompute(self.model)
        if self.world_size > 1:
            self._shard()
        self.pad_id = AutoTokenizer.from_pretrained(self.model_path).pad_token_id or 0
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, settings.optimizer, settings.adapter.lr)
        self.step = 0
        self.estimator = settings.estimator()
        self.loss_config = settings.loss_config()

    def _shard(self) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in lora_model.decoder_layers(self.model):
            fully_shard(layer)
        fully_shard(self.model)

    # ---- log-probs ----

    def _local(self, items: Sequence[Any]) -> list[Any]:
        return list(items[self.rank :: self.world_size])

    def _micro_batches(self, batch: TokenBatch, rows: list[int]) -> list[list[int]]:
        """Positions in `rows` per micro-batch, as many on every rank (FSDP's collectives pair up forward by
        forward)."""
        every_row = row_lengths(batch)
        return agreed_micro_batches(
            [every_row[r] for r in rows],
            size=self.settings.micro_batch_size,
            max_tokens=self.settings.max_tokens_per_micro_batch,
            world_size=self.world_size,
        )

    @torch.no_grad()
    def _log_probs(self, batch: TokenBatch, *, adapter: bool = True) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(batch.loss_mask.shape)
        cut = self.settings.max_tokens_per_micro_batch > 0
        with nullcontext() if adapter else self.model.disable_adapter():
            for rows in self._micro_batches(batch, list(range(batch.input_ids.shape[0]))):
                part = batch.select(torch.tensor(rows))
                width = max(row_lengths(part)) if cut else part.input_ids.shape[1]
                log_probs = token_log_probs(self.model, cut_columns(part, width), temperature=self.settings.temperature)
                out[rows, : width - 1] = log_probs[0]
        return out

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        """The trainer's log-probs of each sample's response tokens (single process)."""
        batch = pack_samples(samples, self.pad_id, self.routing)
        return response_values(self._log_probs(batch, adapter=adapter), samples)

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        """The adapter's raw logprobs of the push probe (weight_sync/probe.py); collective under FSDP2."""
        self.model.eval()
        return sequence_log_probs(self.model, token_ids)

    # ---- training ----

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One rollout's update. Samples are ordered group by group; every rank passes the same full list."""
        s = self.settings
        check_routed_experts(samples, self.routing)  # the whole batch on every rank: all fail alike
        rewards = torch.tensor([float(x.reward if x.reward is not None else 0.0) for x in samples])
        gbs = s.global_batch_size or len(samples)
        if len(samples) % gbs or gbs % self.world_size:
            raise ValueError(f"{len(samples)} samples, global batch {gbs} and {self.world_size} ranks do not divide")
        means = MetricMeans()
        step_chunks = [range(i, i + gbs) for i in range(0, len(samples), gbs)]
        local_all = self._local(range(len(samples)))
        full = pack_samples([samples[i] for i in local_all], self.pad_id, self.routing)
        old = self._old_log_probs(full, single_step=len(step_chunks) == 1)
        ref = self._log_probs(full, adapter=False) if s.algorithm.kl_coef > 0 else None
        advantages = self.estimator.advantages(
            rewards,
            local_all,
            full.loss_mask,
            full.attention_mask[:, 1:],
            self._reward_kl(full, old, ref),
            dist.all_reduce if self.world_size > 1 else None,
        )
        for chunk in step_chunks:
            rows = [local_all.index(i) for i in self._local(chunk)]
            self._optimizer_step(full, rows, advantages[rows], old, ref, means)
        metrics = means.result()
        metrics["loss"] /= len(step_chunks)
        metrics.update(reward_mean=float(rewards.mean()), step=float(self.step), lr=s.adapter.lr)
        return metrics

    def _old_log_probs(self, full: TokenBatch, *, single_step: bool) -> torch.Tensor | None:
        if self.settings.algorithm.use_rollout_logprobs:
            if not full.has_rollout_log_probs:
                raise ValueError("algorithm.use_rollout_logprobs needs every sample's rollout_log_probs")
            return full.rollout_log_probs
        # One step per rollout: the parameters do not move before the loss, so old = current (detached).
        return None if single_step else self._log_probs(full)

    def _reward_kl(self, full: TokenBatch, old: torch.Tensor | None, ref: torch.Tensor | None) -> torch.Tensor | None:
        """Per-token KL of the pre-update policy to the reference, where the estimator puts it in the reward."""
        if not self.estimator.kl_in_reward or ref is None:
            return None
        return k3_kl(self._log_probs(full) if old is None else old, ref)

    def _optimizer_step(
        self,
        full: TokenBatch,
        rows: list[int],
        advantages: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        means: MetricMeans,
    ) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        accumulate_policy_gradients(
            self.model,
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
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.settings.optimizer.clip_grad
        )
        self.optimizer.step()
        self.step += 1
        means.add({"grad_norm": float(grad_norm)}, 1.0)

    def _normalizer(self, full: TokenBatch, rows: list[int]) -> float:
        if not self.loss_config.per_token_loss:
            return float(len(rows))
        # FSDP averages gradients over ranks: each rank divides by the step's tokens over all ranks / ranks.
        tokens = full.loss_mask[torch.tensor(rows)].sum()
        if self.world_size > 1:
            dist.all_reduce(tokens)
        return float(tokens.clamp(min=1)) / self.world_size

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

    def save_adapter(self, out_dir: str | Path) -> Path:
        """Write a PEFT folder (adapter_config.json + adapter_model.safetensors) atomically; rank 0 writes."""
        state = self.adapter_state()
        out = Path(out_dir)
        if self.rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
            self.model.save_pretrained(staging, state_dict=state)
            if out.exists():
                shutil.rmtree(out)
            os.replace(staging, out)
        if self.world_size > 1:
            dist.barrier()
        return out

    def state_dict(self) -> dict[str, Any]:
        """Adapter, optimizer, RNG and step, as full tensors (collective under FSDP2; complete on rank 0)."""
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
