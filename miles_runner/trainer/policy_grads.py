"""The pieces of a policy update that every trainer shares: the optimizer it builds, the loss settings of the
plan's algorithm, and the micro-batched backward pass of the one policy loss (loss.py) over rows of a packed batch.

The one-adapter trainers (policy_trainer.py) step after every global batch; the multi-LoRA trainer
(multi_lora.py) keeps gradients across train calls and steps an adapter only when its batch is complete.
Both accumulate gradients with `accumulate_policy_gradients`.
"""

from __future__ import annotations

import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.trainer.advantages import loss_kl_coef, sequence_ratio
from miles_runner.trainer.cpu_offload_optimizer import hybrid_device_optimizer, offloads
from miles_runner.trainer.logprobs import TokenBatch, token_log_probs
from miles_runner.trainer.loss import PolicyLossConfig, policy_loss
from miles_runner.trainer.metrics import MetricMeans
from miles_runner.trainer.micro_batches import cut_columns, token_columns
from miles_runner.trainer.routing_replay import ReplayStats, replaying


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    """The plan's optimizer over `params`; with optimizer.cpu_offload and parameters on a GPU, Megatron's
    HybridDeviceOptimizer (cpu_offload_optimizer.py; on a CPU host the state is in host memory already)."""
    if cfg.cpu_offload and offloads(params):
        return hybrid_device_optimizer(params, cfg, lr)
    if cfg.name == "adam":
        return torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.name == "muon":
        # Every LoRA parameter is a matrix (A: r x in, B: out x r), which is what Muon orthogonalises; its other
        # hyperparameters (momentum 0.95, Nesterov, 5 Newton-Schulz steps) are torch's defaults.
        return torch.optim.Muon(params, lr=lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer.name must be adam, sgd or muon, not {cfg.name!r}")


def loss_config(algorithm: AlgorithmConfig, *, per_token_loss: bool = False) -> PolicyLossConfig:
    """The loss settings of the plan's algorithm; its advantage estimator decides whether the KL is a loss term
    and whether the ratio is per sample (GSPO)."""
    a = algorithm
    return PolicyLossConfig(
        a.eps_clip,
        a.eps_clip_high,
        loss_kl_coef(a),
        a.entropy_coef,
        a.use_tis,
        per_token_loss=per_token_loss,
        sequence_ratio=sequence_ratio(a),
    )


def accumulate_policy_gradients(
    model,
    full: TokenBatch,
    rows: list[int],
    advantages: torch.Tensor,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    config: PolicyLossConfig,
    means: MetricMeans,
    *,
    temperature: float,
    micro_batches: list[list[int]],
    normalizer: float,
    cut: bool = False,
) -> None:
    """Backward the policy loss of `rows` of `full` (advantages aligned with `rows`) in `micro_batches`
    (positions in `rows`), adding to the parameters' gradients; `old` None means on-policy (old = current,
    detached). `cut`: a micro-batch keeps only the columns of its longest row (the token budget)."""
    model.train()
    for positions in micro_batches:
        idx = torch.tensor([rows[p] for p in positions])
        batch = full.select(idx)
        width = int(batch.attention_mask.sum(dim=1).max()) if cut else batch.input_ids.shape[1]
        batch = cut_columns(batch, width)
        replay = ReplayStats()
        with replaying(model, batch.routed_experts, replay):  # through the backward: recomputed layers route alike
            log_probs, entropy = token_log_probs(model, batch, temperature=temperature, with_entropy=True)
            assert entropy is not None  # asked for: with_entropy
            out = policy_loss(
                log_probs,
                log_probs.detach() if old is None else token_columns(old[idx], width),
                token_columns(advantages[torch.tensor(positions)], width),
                batch.loss_mask,
                config,
                rollout_log_probs=batch.rollout_log_probs if batch.has_rollout_log_probs else None,
                ref_log_probs=None if ref is None else token_columns(ref[idx], width),
                entropy=entropy if config.entropy_coef else entropy.detach(),
                normalizer=normalizer,
            )
            out.loss.backward()
        tokens = float(batch.loss_mask.sum())
        means.add(out.metrics, tokens)
        if batch.has_rollout_log_probs:
            means.add({"rollout_logprob_abs_diff": rollout_abs_diff(log_probs, batch)}, tokens)
        if replay.tokens:  # routing replay: the share of tokens the trainer's own routers would send elsewhere
            means.add({"routing_replay_diff_frac": replay.diff_frac}, replay.tokens)
        means.add_sum("loss", float(out.loss.detach()))


def rollout_abs_diff(log_probs: torch.Tensor, batch: TokenBatch) -> float:
    """Mean |trainer - rollout| log-prob over trained tokens: the trainer/engine mismatch figure."""
    mask = batch.loss_mask
    return float(((log_probs.detach() - batch.rollout_log_probs).abs() * mask).sum() / mask.sum().clamp(min=1))
