"""The policy update of one adapter, written once for the trainers of one adapter: `FSDPTrainer` (fsdp.py) and
`MegatronTrainer` (megatron/trainer.py; `BridgeTrainer`, megatron/bridge.py, is MegatronTrainer with Bridge's model).

``train(samples)`` is one rollout's update: the plan's advantages (trainer/advantages.py), then one optimizer step
per ``global_batch_size`` samples, each accumulated over micro-batches (trainer/micro_batches.py). Old log-probs are
the rollout's (``algorithm.use_rollout_logprobs``) or the trainer's own before the first step; the KL reference is
the same model with the adapter off. With ``routing_replay`` (R3) every forward routes each token to the experts
the rollout chose (trainer/routing_replay.py).

The data-parallel ranks (`DataParallel`) each train on their strided share of every batch. Every rank of the world
runs as many forwards as the others (FSDP's collectives and the MoE token dispatcher pair them up), so micro-batch
counts are agreed over the whole world first. A subclass gives the model and its adapter: the parameters, how the
adapter is switched off, how the gradients are completed before a step, and how its PEFT folder is written.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.core.atomic_folder import replace_folder, staging_folder
from miles_runner.core.host_memory import rss_bytes
from miles_runner.models.moe_routing import RoutingLayout
from miles_runner.plan.model import Plan
from miles_runner.trainer.advantages import Estimator
from miles_runner.trainer.distributed import rank_and_world
from miles_runner.trainer.logprobs import (
    TokenBatch,
    TrainingSample,
    pack_samples,
    response_values,
    sequence_log_probs,
)
from miles_runner.trainer.loss import PolicyLossConfig, k3_kl
from miles_runner.trainer.metrics import MetricMeans
from miles_runner.trainer.micro_batches import agreed_micro_batches, micro_batched_log_probs, row_lengths
from miles_runner.trainer.policy_grads import accumulate_policy_gradients, build_optimizer, loss_config
from miles_runner.trainer.routing_replay import check_routed_experts
from miles_runner.trainer.train_offload import OffloadReport, OffloadSettings, TrainStateOffload, offload_settings

T = TypeVar("T")


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
    offload: OffloadSettings | None = None  # topology.offload_train: where the state goes between trains

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
            offload=offload_settings(plan),
        )

    def estimator(self) -> Estimator:
        return Estimator.from_algorithm(self.algorithm, self.group_size)

    def loss_config(self) -> PolicyLossConfig:
        return loss_config(self.algorithm, per_token_loss=self.per_token_loss)


@dataclass(frozen=True)
class DataParallel:
    """The ranks that split every batch's samples between them, strided, and their process group (None: the
    default group)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's share of `items`."""
        return list(items[self.rank :: self.size])

    def all_reduce(self) -> Callable[[torch.Tensor], Any] | None:
        """The in-place sum over these ranks; None for one rank."""
        return functools.partial(dist.all_reduce, group=self.group) if self.size > 1 else None


class PolicyTrainer(ABC):
    """One adapter trained with the plan's policy loss: the shared part of the trainers of `interface.Trainer`."""

    ranks_name = "ranks"  # what the batch-size error calls the data-parallel ranks

    def __init__(
        self,
        settings: TrainerSettings,
        model: torch.nn.Module,
        *,
        net: torch.nn.Module | None = None,
        pad_id: int,
        routing: RoutingLayout | None,
        dp: DataParallel | None = None,
    ) -> None:
        """`net` is what the loss calls (`model` unless a wrapper packs its rows); `dp` the data-parallel ranks
        (every rank unless the layout says otherwise)."""
        self.settings, self.model, self.net = settings, model, model if net is None else net
        self.pad_id, self.routing = pad_id, routing
        self.rank, self.world_size = rank_and_world()
        self.dp = dp or DataParallel(self.rank, self.world_size)
        self.optimizer = build_optimizer(self._lora_parameters(), settings.optimizer, settings.adapter.lr)
        self.offloader = (
            TrainStateOffload(settings.offload, model, self.optimizer, self.rank) if settings.offload else None
        )
        self.step = 0
        self.estimator = settings.estimator()
        self.loss_config = settings.loss_config()

    # ---- what a subclass gives ----

    @abstractmethod
    def _lora_parameters(self) -> list[torch.nn.Parameter]:
        """The adapter's parameters: what the optimizer steps."""

    @abstractmethod
    def _adapter_enabled(self, on: bool) -> AbstractContextManager[Any]:
        """A context in which the adapter applies (on) or not (the base policy, the KL reference)."""

    @abstractmethod
    def _complete_grads(self) -> float:
        """Make the accumulated gradients the step's (reduced over the ranks where the backward did not, clipped);
        the gradient norm before clipping."""

    @abstractmethod
    def _write_adapter(self, folder: Path) -> None:
        """Write the PEFT folder into `folder`. Every rank calls it (the export is collective); rank 0 writes."""

    # ---- log-probs ----

    def _micro_batches(self, batch: TokenBatch, rows: list[int]) -> list[list[int]]:
        """Positions in `rows` per micro-batch, as many on every rank (the collectives of the forwards pair up)."""
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
        with self._adapter_enabled(adapter):
            return micro_batched_log_probs(
                self.net,
                batch,
                self._micro_batches(batch, list(range(batch.input_ids.shape[0]))),
                temperature=self.settings.temperature,
                cut=self.settings.max_tokens_per_micro_batch > 0,
            )

    def compute_log_probs(self, samples: Sequence[TrainingSample], *, adapter: bool = True) -> list[list[float]]:
        """The trainer's log-probs of each sample's response tokens (every rank computes all of them)."""
        self._resident()
        batch = pack_samples(samples, self.pad_id, self.routing)
        return response_values(self._log_probs(batch, adapter=adapter), samples)

    def probe_log_probs(self, token_ids: Sequence[int]) -> list[float]:
        """The adapter's raw logprobs of the push probe (weight_sync/probe.py); collective."""
        self._resident()
        self.model.eval()
        return sequence_log_probs(self.net, token_ids)

    # ---- training offload (train_offload.py) ----

    def offload_state(self) -> dict[str, Any]:
        """Move the frozen weights, gradients and optimizer state out (trainer.offload_target); what moved."""
        report = self.offloader.offload() if self.offloader else None
        return self._offload_record(report)

    def onload_state(self) -> dict[str, Any]:
        """Bring them back (every call that needs them does it first, too)."""
        report = self.offloader.onload() if self.offloader else None
        return self._offload_record(report)

    def _resident(self) -> None:
        if self.offloader is not None and self.offloader.offloaded:
            self.offloader.onload()

    def _offload_record(self, report: OffloadReport | None) -> dict[str, Any]:
        target = self.settings.offload.target if self.settings.offload else "none"
        moved, chunks = (report.moved_bytes, report.chunks) if report else (0, 0)
        return {"target": target, "moved_bytes": moved, "chunks": chunks, "rss_bytes": rss_bytes()}

    # ---- training ----

    def train(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One rollout's update. Samples are ordered group by group; every rank passes the same full list."""
        self._resident()
        s, dp = self.settings, self.dp
        check_routed_experts(samples, self.routing)  # the whole batch on every rank: all fail alike
        rewards = torch.tensor([float(x.reward if x.reward is not None else 0.0) for x in samples])
        gbs = s.global_batch_size or len(samples)
        if len(samples) % gbs or gbs % dp.size:
            raise ValueError(
                f"{len(samples)} samples, global batch {gbs} and {dp.size} {self.ranks_name} do not divide"
            )
        means = MetricMeans()
        step_chunks = [range(i, i + gbs) for i in range(0, len(samples), gbs)]
        local_all = dp.share(range(len(samples)))
        full = pack_samples([samples[i] for i in local_all], self.pad_id, self.routing)
        old = self._old_log_probs(full, single_step=len(step_chunks) == 1)
        ref = self._log_probs(full, adapter=False) if s.algorithm.kl_coef > 0 else None
        kl = self._reward_kl(full, old, ref)
        valid = full.attention_mask[:, 1:]
        advantages = self.estimator.advantages(rewards, local_all, full.loss_mask, valid, kl, dp.all_reduce())
        for chunk in step_chunks:
            rows = [local_all.index(i) for i in dp.share(chunk)]
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
        means.add({"grad_norm": grad_norm}, 1.0)

    def _normalizer(self, full: TokenBatch, rows: list[int]) -> float:
        if not self.loss_config.per_token_loss:
            return float(len(rows))
        # Gradients are averaged over the data-parallel ranks: each divides by the step's tokens over all of them,
        # over their number.
        tokens = full.loss_mask[torch.tensor(rows, dtype=torch.long)].sum() if rows else torch.tensor(0.0)
        if (all_reduce := self.dp.all_reduce()) is not None:
            all_reduce(tokens)
        return float(tokens.clamp(min=1)) / self.dp.size

    # ---- export ----

    def adapter_views(self) -> dict[str, torch.Tensor] | None:
        """None: this trainer exports copies of its adapter (converted names, or shards), nothing to share."""
        return None

    def move_adapter(self, homes: dict[str, torch.Tensor]) -> None:
        raise TypeError(f"{type(self).__name__} has no adapter views (adapter_views() is None): nothing to move")

    def save_adapter(self, out_dir: str | Path) -> Path:
        """A PEFT folder (adapter_config.json + adapter_model.safetensors) at `out_dir`, replaced whole
        (core/atomic_folder.py); collective, rank 0 writes."""
        out = Path(out_dir)
        if self.rank == 0:
            replace_folder(out, self._write_adapter)
        else:  # its part of the collective export, which writes nothing here
            self._write_adapter(staging_folder(out))
        if self.world_size > 1:
            dist.barrier()
        return out
