"""The pieces of a GRPO update that every trainer shares: the optimizer it builds and the micro-batched
backward pass of the one policy loss (loss.py) over rows of a packed batch.

The single-adapter trainer (fsdp.py) steps after every global batch; the multi-adapter trainer
(multi_adapter.py) keeps gradients across train calls and steps an adapter only when its batch is complete.
Both accumulate gradients with `accumulate_policy_gradients`.
"""

from __future__ import annotations

import torch

from miles_runner.config.schema import OptimizerConfig
from miles_runner.trainer.logprobs import TokenBatch, token_log_probs
from miles_runner.trainer.loss import PolicyLossConfig, policy_loss
from miles_runner.trainer.metrics import MetricMeans


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimizerConfig, lr: float) -> torch.optim.Optimizer:
    if cfg.name == "adam":
        return torch.optim.AdamW(params, lr=lr, betas=(cfg.adam_beta1, cfg.adam_beta2), weight_decay=cfg.weight_decay)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=cfg.weight_decay)
    raise ValueError(f"the FSDP trainer supports optimizer adam or sgd, not {cfg.name!r}")


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
    micro_batch_size: int,
    normalizer: float,
) -> None:
    """Backward the policy loss of `rows` of `full` (advantages aligned with `rows`) in micro-batches, adding
    to the parameters' gradients; `old` None means on-policy (old = current, detached)."""
    model.train()
    for start in range(0, len(rows), micro_batch_size):
        idx = torch.tensor(rows[start : start + micro_batch_size])
        batch = full.select(idx)
        log_probs, entropy = token_log_probs(model, batch, temperature=temperature, with_entropy=True)
        out = policy_loss(
            log_probs,
            log_probs.detach() if old is None else old[idx],
            advantages[start : start + micro_batch_size],
            batch.loss_mask,
            config,
            rollout_log_probs=batch.rollout_log_probs if batch.has_rollout_log_probs else None,
            ref_log_probs=None if ref is None else ref[idx],
            entropy=entropy if config.entropy_coef else entropy.detach(),
            normalizer=normalizer,
        )
        out.loss.backward()
        tokens = float(batch.loss_mask.sum())
        means.add(out.metrics, tokens)
        if batch.has_rollout_log_probs:
            means.add({"rollout_logprob_abs_diff": rollout_abs_diff(log_probs, batch)}, tokens)
        means.add_sum("loss", float(out.loss.detach()))


def rollout_abs_diff(log_probs: torch.Tensor, batch: TokenBatch) -> float:
    """Mean |trainer - rollout| log-prob over trained tokens: the trainer/engine mismatch figure."""
    mask = batch.loss_mask
    return float(((log_probs.detach() - batch.rollout_log_probs).abs() * mask).sum() / mask.sum().clamp(min=1))
