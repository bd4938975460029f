"""The one policy loss, shared by the FSDP and Megatron trainers. Pure torch; no model code.

Every per-token tensor is ``[batch, tokens]`` with a 0/1 ``mask`` saying which positions are trained
(response tokens with ``loss_mask`` 1); padding and prompt positions carry mask 0 and any value.

The advantages it weighs come from ``advantages.Estimator`` (GRPO, GSPO, REINFORCE++ and its baseline variant).

- ``policy_loss``: the PPO-clipped surrogate with asymmetric clip ``[1 - eps_clip, 1 + eps_clip_high]``
  against ``old_log_probs`` (the rollout's, or the trainer's recomputation of them); with ``sequence_ratio``
  (GSPO) every token of a sample shares the ratio of the sample's mean log-ratio; an optional truncated
  importance-sampling (TIS) weight ``min(exp(old - rollout), tis_clip)`` for the trainer/engine mismatch, an
  optional k3 KL penalty to the reference policy (the base model: the same weights with the adapter off)
  and an optional entropy bonus.

Aggregation follows miles: each sample's tokens are averaged, then samples are averaged
(``per_token_loss`` instead divides the token sum by the token count). ``normalizer`` overrides the
denominator (samples, or tokens) so micro-batches of one global batch add up to the global mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

KL_CLAMP = 10.0  # miles clamps the low-variance KL estimate to [-10, 10]


def k3_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Per-token k3 (low-variance) estimate of KL(policy || reference): exp(r) - 1 - r, r = ref - policy."""
    log_ratio = ref_log_probs - log_probs
    return (log_ratio.exp() - 1 - log_ratio).clamp(-KL_CLAMP, KL_CLAMP)


@dataclass(frozen=True)
class PolicyLossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    per_token_loss: bool = False
    sequence_ratio: bool = False  # GSPO: one ratio per sample, exp(mean over its tokens of the log-ratio)


@dataclass(frozen=True)
class PolicyLossOutput:
    loss: Tensor  # scalar, differentiable
    metrics: dict[str, float]  # token means over the mask (clip_fraction, ratio_mean, kl, entropy, ...)


def masked_reduce(values: Tensor, mask: Tensor, per_token: bool, normalizer: float | None = None) -> Tensor:
    """Sum of per-sample token means / samples, or token sum / tokens; ``normalizer`` replaces the count."""
    mask = mask.to(values.dtype)
    if per_token:
        return (values * mask).sum() / (normalizer if normalizer is not None else mask.sum().clamp(min=1))
    per_sample = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sample.sum() / (normalizer if normalizer is not None else values.shape[0])


def _token_mean(values: Tensor, mask: Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values.detach() * mask).sum() / mask.sum().clamp(min=1))


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    rollout_log_probs: Tensor | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    normalizer: float | None = None,
) -> PolicyLossOutput:
    """The clipped GRPO/PPO objective (to minimise). ``advantages`` is per sample ``[B]`` or per token."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    log_ratio = log_probs - old_log_probs
    if config.sequence_ratio:
        mask_f = mask.to(log_ratio.dtype)
        per_sample = (log_ratio * mask_f).sum(dim=1, keepdim=True) / mask_f.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = per_sample.expand_as(log_ratio)
    ratio = log_ratio.exp()
    unclipped = -ratio * adv
    clipped = -ratio.clamp(1 - config.eps_clip, 1 + config.eps_clip_high) * adv
    pg_tokens = torch.maximum(unclipped, clipped)
    metrics = {
        "clip_fraction": _token_mean((clipped > unclipped).float(), mask),
        "ratio_mean": _token_mean(ratio, mask),
    }
    if config.use_tis:
        if rollout_log_probs is None:
            raise ValueError("use_tis needs rollout_log_probs")
        tis = (old_log_probs - rollout_log_probs).exp().clamp(max=config.tis_clip).detach()
        pg_tokens = pg_tokens * tis
        metrics["tis_mean"] = _token_mean(tis, mask)
    loss_tokens = pg_tokens
    metrics["pg_loss"] = float(masked_reduce(pg_tokens.detach(), mask, config.per_token_loss))
    if ref_log_probs is not None:
        kl = k3_kl(log_probs, ref_log_probs)
        metrics["kl"] = _token_mean(kl, mask)
        loss_tokens = loss_tokens + config.kl_coef * kl
    if entropy is not None:
        metrics["entropy"] = _token_mean(entropy, mask)
        loss_tokens = loss_tokens - config.entropy_coef * entropy
    loss = masked_reduce(loss_tokens, mask, config.per_token_loss, normalizer)
    return PolicyLossOutput(loss, metrics)
