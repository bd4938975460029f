"""The multi-LoRA trainers (docs/system.md §4.7): several LoRA adapters on one frozen base model, one per engine
slot; `interface.MultiLoRATrainer` is what the multi-LoRA loop asks of them. `SlotTrainer` is their update, written
once; `PeftMultiLoRATrainer` (here) keeps the slots as peft adapters, the Megatron trainer as raw LoRA slots
(megatron/multi_lora.py).

Each slot has its own peft adapter (named as the engine slot, `__miles_slot_K`), its own optimizer and its own
step scale. `train(samples, step_slots)` backwards every sample's GRPO loss into its slot's adapter (samples
carry `metadata["slot"]`); gradients are kept across train calls, and only the slots in `step_slots` step:
their gradients are scaled by 1/adapter_global_batch_size, clipped, applied, and cleared. A slot that is
cleared and loaded again (a new tenant) starts with a fresh adapter and a fresh optimizer. With `routing_replay`
(R3) every forward routes each token to the experts its rollout chose (trainer/routing_replay.py).

Data parallel across trainer ranks (trainer/ranks.py replays every call on each rank): each rank holds the
whole base model and every slot's adapter (they are small), backwards its strided share of each slot's
samples, and a slot's step first sums its gradients over the ranks, so every rank applies the same update.
The base model carries one idle adapter that is never trained or exported (peft needs one to exist while
slots come and go).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.models.moe_routing import RoutingLayout, routing_layout
from miles_runner.plan.model import Plan
from miles_runner.trainer import lora_model
from miles_runner.trainer.advantages import Estimator, masked_whiten
from miles_runner.trainer.distributed import rank_and_world
from miles_runner.trainer.logprobs import TokenBatch, TrainingSample, pack_samples, sequence_log_probs
from miles_runner.trainer.loss import PolicyLossConfig, k3_kl
from miles_runner.trainer.metrics import MetricMeans
from miles_runner.trainer.micro_batches import micro_batched_log_probs, plan_micro_batches, row_lengths
from miles_runner.trainer.policy_grads import accumulate_policy_gradients, build_optimizer, loss_config
from miles_runner.trainer.policy_trainer import DataParallel
from miles_runner.trainer.routing_replay import check_routed_experts

IDLE_ADAPTER = "__idle"


@dataclass(frozen=True)
class MultiLoRASettings:
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    micro_batch_size: int
    temperature: float = 1.0
    seed: int = 0
    routing_replay: bool = False  # R3: train with the rollout's expert choices (rollout.routing_replay)
    recompute: bool = False  # trainer.parallel.recompute: gradient checkpointing of every decoder layer
    max_tokens_per_micro_batch: int = 0  # trainer.use_dynamic_batch_size: the token budget; 0: micro_batch_size

    @classmethod
    def from_plan(cls, plan: Plan) -> MultiLoRASettings:
        return cls(
            plan.algorithm,
            plan.optimizer,
            plan.trainer.parallel.micro_batch_size,
            plan.rollout.temperature,
            plan.seed,
            routing_replay=plan.capabilities.use_routing_replay,
            recompute=plan.trainer.parallel.recompute,
            max_tokens_per_micro_batch=plan.trainer.max_tokens_per_micro_batch,
        )

    def loss_config(self) -> PolicyLossConfig:
        return loss_config(self.algorithm)


@dataclass
class _Slot:
    adapter: AdapterSpec  # lora_name is the peft adapter name and the engine slot name
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    step: int = 0
    pending_samples: int = 0  # samples whose gradients are accumulated since the last step


class SlotTrainer(ABC):
    """The multi-LoRA update, written once for its backends: `PeftMultiLoRATrainer` (here) and the Megatron one
    (megatron/multi_lora.py). A subclass installs, activates and clears a slot's adapter, completes a slot's
    gradients over its ranks, and exports a slot."""

    def __init__(
        self,
        settings: MultiLoRASettings,
        model: torch.nn.Module,
        *,
        net: torch.nn.Module | None = None,
        pad_id: int,
        routing: RoutingLayout | None,
        dp: DataParallel,
    ) -> None:
        """`net` is what the loss calls (`model` unless a wrapper packs its rows); `dp` the ranks that split each
        slot's samples."""
        self.settings, self.model, self.net = settings, model, model if net is None else net
        self.loss_config = settings.loss_config()
        self.pad_id, self.routing, self.dp = pad_id, routing, dp
        self.slots: dict[int, _Slot] = {}

    # ---- what a subclass gives ----

    @abstractmethod
    def _install(self, slot: int, adapter: AdapterSpec) -> list[torch.nn.Parameter]:
        """A fresh adapter (A random from the slot's seed, B zero) in `slot`; its trainable parameters."""

    @abstractmethod
    def _uninstall(self, slot: int, entry: _Slot) -> None:
        """Drop the slot's adapter from the model."""

    @abstractmethod
    def _active(self, slot: int) -> AbstractContextManager[Any]:
        """A context in which the slot's adapter is the one the forward applies (and trains)."""

    @abstractmethod
    def _adapter_off(self) -> AbstractContextManager[Any]:
        """A context in which no adapter applies (the KL reference)."""

    @abstractmethod
    def _complete_grads(self, slot: int, scale: float) -> float:
        """Make the slot's accumulated gradients its step's: summed over the ranks, times `scale`, clipped; the
        norm before clipping."""

    @abstractmethod
    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        """The slot's adapter tensors in PEFT naming (what the engines load under the slot name)."""

    @abstractmethod
    def adapter_config(self, slot: int) -> dict[str, Any]:
        """The PEFT config of the slot's `adapter_state`."""

    def _micro_batches(self, full: TokenBatch, rows: list[int]) -> list[list[int]]:
        """Positions in `rows` per micro-batch."""
        s = self.settings
        return plan_micro_batches(
            [row_lengths(full)[r] for r in rows], size=s.micro_batch_size, max_tokens=s.max_tokens_per_micro_batch
        )

    # ---- slots --------------------------------------------------------------------------------------

    def load_adapter(self, slot: int, adapter: AdapterSpec, state: dict[str, Any] | None = None) -> None:
        """Install a fresh adapter (A random, B zero) and optimizer in `slot`, or the saved `state` of one."""
        if slot in self.slots:
            raise ValueError(f"slot {slot} still holds {self.slots[slot].adapter.name}; clear it first")
        params = self._install(slot, adapter)
        if not params:
            raise ValueError(f"target_modules {adapter.target_modules} gave adapter {adapter.name} no parameters")
        for p in params:
            p.requires_grad_(True)
        entry = _Slot(adapter, params, build_optimizer(params, self.settings.optimizer, adapter.lr))
        self.slots[slot] = entry
        if state is not None:
            self._load_slot_state(slot, entry, state)

    def clear_adapter(self, slot: int) -> None:
        """Drop the slot's adapter, its retained gradients and its optimizer state."""
        entry = self.slots.pop(slot, None)
        if entry is not None:
            self._uninstall(slot, entry)

    # ---- training -----------------------------------------------------------------------------------

    def train(self, samples: Sequence[TrainingSample], step_slots: Collection[int]) -> dict[int, dict[str, float]]:
        """Accumulate every sample's gradients into its slot's adapter (samples group by group, as a TrainBatch
        orders them), then step the slots in `step_slots`. Returns metrics per slot that had samples or stepped."""
        check_routed_experts(samples, self.routing)  # the whole batch on every rank: all fail alike
        by_slot: dict[int, list[TrainingSample]] = {}
        for sample in samples:
            by_slot.setdefault(int(sample.metadata["slot"]), []).append(sample)
        unknown = sorted(set(by_slot) - set(self.slots)) + sorted(set(step_slots) - set(self.slots))
        if unknown:
            raise ValueError(f"samples or steps for slots {unknown}, which hold no adapter")
        metrics = {slot: self._backward(slot, group) for slot, group in sorted(by_slot.items())}
        for slot in sorted(step_slots):
            metrics.setdefault(slot, {}).update(self._step(slot))
        return metrics

    def _backward(self, slot: int, samples: list[TrainingSample]) -> dict[str, float]:
        entry, s, dp = self.slots[slot], self.settings, self.dp
        rewards = torch.tensor([float(x.reward if x.reward is not None else 0.0) for x in samples])
        # The slot's own samples of this call set its baselines and whitening statistics: tenants never mix.
        estimator = Estimator.from_algorithm(s.algorithm, entry.adapter.n_samples_per_prompt)
        all_reduce = dp.all_reduce()
        local = dp.share(range(len(samples)))  # whole groups set the advantages; ranks share the rows
        means = MetricMeans()
        if local:
            with self._active(slot):
                full = pack_samples([samples[i] for i in local], self.pad_id, self.routing)
                old = full.rollout_log_probs if s.algorithm.use_rollout_logprobs else None  # else on-policy
                ref = self._log_probs(full, adapter=False) if s.algorithm.kl_coef > 0 else None
                kl = k3_kl(self._log_probs(full) if old is None else old, ref) if estimator.kl_in_reward else None
                valid = full.attention_mask[:, 1:]
                advantages = estimator.advantages(rewards, local, full.loss_mask, valid, kl, all_reduce)
                self._accumulate(full, advantages, old, ref, means)
        elif all_reduce is not None and estimator.whitens:
            masked_whiten(torch.zeros(1, 1), torch.zeros(1, 1), all_reduce)  # the ranks with rows whiten together
        entry.pending_samples += len(samples)
        # "samples": this rank's, the ones its loss sum covers; the reward is over the whole batch.
        return {**means.result(), "reward_mean": float(rewards.mean()), "samples": float(len(local))}

    def _accumulate(
        self,
        full: TokenBatch,
        advantages: torch.Tensor,
        old: torch.Tensor | None,
        ref: torch.Tensor | None,
        means: MetricMeans,
    ) -> None:
        rows = list(range(full.input_ids.shape[0]))
        # Normalizer 1: each sample adds its own loss; the step divides by the adapter's global batch size.
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
            normalizer=1.0,
            cut=self.settings.max_tokens_per_micro_batch > 0,
        )

    @torch.no_grad()
    def _log_probs(self, full: TokenBatch, *, adapter: bool = True) -> torch.Tensor:
        """The active slot's log-probs of the batch, or (adapter off) the reference's."""
        self.net.eval()
        with nullcontext() if adapter else self._adapter_off():
            return micro_batched_log_probs(
                self.net,
                full,
                self._micro_batches(full, list(range(full.input_ids.shape[0]))),
                temperature=self.settings.temperature,
                cut=self.settings.max_tokens_per_micro_batch > 0,
            )

    def probe_log_probs(self, token_ids: Sequence[int], slot: int) -> list[float]:
        """The slot's adapter's raw logprobs of the push probe (weight_sync/probe.py)."""
        self.net.eval()
        with self._active(slot):
            return sequence_log_probs(self.net, token_ids)

    def _step(self, slot: int) -> dict[str, float]:
        entry = self.slots[slot]
        batch_size = entry.adapter.rollout_batch_size * entry.adapter.n_samples_per_prompt
        grad_norm = self._complete_grads(slot, 1.0 / batch_size)
        entry.optimizer.step()
        entry.optimizer.zero_grad(set_to_none=True)
        entry.step += 1
        stepped = {"grad_norm": grad_norm, "step": float(entry.step), "step_samples": entry.pending_samples}
        entry.pending_samples = 0
        return stepped

    # ---- checkpoints ---------------------------------------------------------------------------------

    def adapter_step(self, slot: int) -> int:
        return self.slots[slot].step

    def state_dict(self, slot: int) -> dict[str, Any]:
        """The slot's adapter, optimizer and step: what a per-adapter checkpoint holds."""
        entry = self.slots[slot]
        return {
            "adapter": [p.detach().cpu().clone() for p in entry.params],
            # A copy: on CPU the returned tensors may alias the live optimizer state, which later steps mutate.
            "optimizer": copy.deepcopy(entry.optimizer.state_dict()),
            "step": entry.step,
        }

    def _load_slot_state(self, slot: int, entry: _Slot, state: dict[str, Any]) -> None:
        saved = state["adapter"]
        if [tuple(t.shape) for t in saved] != [tuple(p.shape) for p in entry.params]:
            raise ValueError(f"checkpoint of adapter {entry.adapter.name} does not match its rank/target modules")
        with torch.no_grad():
            for param, tensor in zip(entry.params, saved, strict=True):
                param.copy_(tensor)
        entry.optimizer.load_state_dict(state["optimizer"])
        entry.step = int(state["step"])


class PeftMultiLoRATrainer(SlotTrainer):
    """Slots as peft adapters of one peft model (see the module docstring)."""

    def __init__(self, model_path: str | Path, settings: MultiLoRASettings) -> None:
        from peft import get_peft_model
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
        idle = AdapterSpec(
            name=IDLE_ADAPTER,
            lora_name=IDLE_ADAPTER,
            rank=1,
            alpha=1.0,
            dropout=0.0,
            target_modules=["q_proj"],
            task="",
            reward="",
            lr=0.0,
            rollout_batch_size=1,
            n_samples_per_prompt=1,
        )
        model = get_peft_model(base, lora_model.lora_config(idle), adapter_name=IDLE_ADAPTER)
        if settings.recompute:
            lora_model.enable_recompute(model)
        for p in model.parameters():
            p.requires_grad_(False)
        super().__init__(
            settings,
            model,
            pad_id=AutoTokenizer.from_pretrained(str(model_path)).pad_token_id or 0,
            routing=routing_layout(model) if settings.routing_replay else None,
            dp=DataParallel(*rank_and_world()),
        )

    def _install(self, slot: int, adapter: AdapterSpec) -> list[torch.nn.Parameter]:
        torch.manual_seed(self.settings.seed + slot)
        self.model.add_adapter(adapter.lora_name, lora_model.lora_config(adapter))
        return [p for n, p in self.model.named_parameters() if f".{adapter.lora_name}." in n]

    def _uninstall(self, slot: int, entry: _Slot) -> None:
        self.model.base_model.set_adapter(IDLE_ADAPTER)
        self.model.delete_adapter(entry.adapter.lora_name)

    def _active(self, slot: int) -> AbstractContextManager[Any]:
        """The slot's adapter stays the active one after (peft then marks only it trainable)."""
        entry = self.slots[slot]
        self.model.base_model.set_adapter(entry.adapter.lora_name)
        for p in entry.params:
            p.requires_grad_(True)
        return nullcontext()

    def _adapter_off(self) -> AbstractContextManager[Any]:
        return self.model.disable_adapter()

    def _complete_grads(self, slot: int, scale: float) -> float:
        params = self.slots[slot].params
        _sum_over_ranks(params)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        return float(torch.nn.utils.clip_grad_norm_(params, self.settings.optimizer.clip_grad))

    # ---- export -------------------------------------------------------------------------------------

    def adapter_state(self, slot: int) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        name = self.slots[slot].adapter.lora_name
        state = get_peft_model_state_dict(self.model, adapter_name=name)
        return {key: tensor.detach().cpu().clone() for key, tensor in state.items()}

    def adapter_config(self, slot: int) -> dict[str, Any]:
        return lora_model.adapter_config_dict(self.slots[slot].adapter)


def _sum_over_ranks(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of every rank's share (a rank that had no sample of the slot adds zeros)."""
    if rank_and_world()[1] == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
