"""The advantage estimators (``algorithm.advantage_estimator``), computed as miles computes them; one dispatch,
``Estimator.advantages``, used by the single-adapter and the multi-LoRA trainer.

Rewards arrive one per sample, group by group (``[g0s0, g0s1, ..., g1s0, ...]``):

- ``grpo``, ``gspo``: the reward minus its group mean, divided by the group's unbiased std when
  ``normalize_std`` (miles' reward normalisation), one value per sample that every token of the sample shares.
  ``gspo`` differs only in the loss (a sequence-level ratio, ``loss.PolicyLossConfig.sequence_ratio``).
- ``reinforce_plus_plus``: per token, the discounted return ``G_t = r_t + gamma * G_{t+1}`` of the token rewards
  ``r_t = -kl_coef * KL_t``, with the sample's raw reward added on its last trained token.
- ``reinforce_plus_plus_baseline``: per token, ``(reward - group mean) - kl_coef * KL_t``.

Both REINFORCE++ variants are then whitened over every trained token of the batch, across all ranks (miles
requires ``--normalize-advantages`` for them): mean 0 and unbiased variance 1. ``KL_t`` is the k3 estimate of
KL(policy || reference) of the pre-update policy; with these two estimators the KL shapes the reward and the loss
gets no KL term (miles keeps ``--kl-coef``, in the reward, and ``--kl-loss-coef``, in the loss, exclusive).
PPO needs a critic, which a LoRA-only trainer does not have: the plan refuses it (rule ppo-needs-critic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles_runner.config.schema import AlgorithmConfig

STD_EPS = 1e-6  # group std (miles' reward normalisation)
WHITEN_EPS = 1e-8  # batch whitening (miles' distributed_masked_whiten)
GROUP_ESTIMATORS = ("grpo", "gspo")
REINFORCE_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")

# Sums a tensor over the trainer's ranks in place; None: one rank.
AllReduce = Callable[[Tensor], None]


@dataclass(frozen=True)
class Estimator:
    name: str
    group_size: int  # samples per prompt: the group of the group baseline
    normalize_std: bool = True
    kl_coef: float = 0.0
    gamma: float = 1.0

    @classmethod
    def from_algorithm(cls, algorithm: AlgorithmConfig, group_size: int) -> Estimator:
        a = algorithm
        return cls(a.advantage_estimator, group_size, a.normalize_advantages_by_std, a.kl_coef, a.gamma)

    def __post_init__(self) -> None:
        if self.name not in GROUP_ESTIMATORS + REINFORCE_ESTIMATORS:
            raise ValueError(
                f"advantage estimator {self.name!r} is not built; use one of "
                f"{list(GROUP_ESTIMATORS + REINFORCE_ESTIMATORS)}"
            )

    @property
    def kl_in_reward(self) -> bool:
        """The KL to the reference shapes the token rewards (REINFORCE++), rather than being a loss term."""
        return self.name in REINFORCE_ESTIMATORS and self.kl_coef > 0

    @property
    def whitens(self) -> bool:
        """Its advantages are whitened over the batch on every rank (a collective when there are several)."""
        return self.name in REINFORCE_ESTIMATORS

    def advantages(
        self,
        rewards: Tensor,
        rows: list[int],
        loss_mask: Tensor,
        valid: Tensor,
        kl: Tensor | None = None,
        all_reduce: AllReduce | None = None,
    ) -> Tensor:
        """The advantages of samples ``rows`` of ``rewards`` (all samples, group by group), whose tokens are the
        ``[len(rows), T]`` ``loss_mask`` (trained) and ``valid`` (real, not padding) columns; ``kl`` is their
        per-token KL when ``kl_in_reward``. ``[len(rows)]`` for grpo/gspo, ``[len(rows), T]`` otherwise."""
        if self.name in GROUP_ESTIMATORS:
            return group_advantages(rewards, self.group_size, self.normalize_std)[rows]
        if self.kl_in_reward and kl is None:
            raise ValueError(f"{self.name} with kl_coef > 0 needs the per-token KL to the reference")
        penalty = torch.zeros_like(loss_mask) if kl is None else self.kl_coef * kl.detach() * valid
        if self.name == "reinforce_plus_plus":
            token_rewards = -penalty + rewards.float()[rows].unsqueeze(1) * last_token(loss_mask)
            advantages = discounted_returns(token_rewards, self.gamma)
        else:
            baseline = group_advantages(rewards, self.group_size, normalize_std=False)[rows]
            advantages = baseline.unsqueeze(1) - penalty
        return masked_whiten(advantages, loss_mask, all_reduce)


def loss_kl_coef(algorithm: AlgorithmConfig) -> float:
    """The KL term's weight in the loss: none where the estimator put the KL into the reward."""
    return 0.0 if algorithm.advantage_estimator in REINFORCE_ESTIMATORS else algorithm.kl_coef


def sequence_ratio(algorithm: AlgorithmConfig) -> bool:
    """GSPO: the loss's importance ratio is per sample."""
    return algorithm.advantage_estimator == "gspo"


def group_advantages(rewards: Tensor, group_size: int, normalize_std: bool) -> Tensor:
    """Per-sample rewards minus the group mean (over the std with ``normalize_std``); a group of one gets 0."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        centered = centered / (grouped.std(dim=1, keepdim=True) + STD_EPS)
    return centered.flatten()


def last_token(loss_mask: Tensor) -> Tensor:
    """A 0/1 tensor marking each row's last trained token, where REINFORCE++ puts the sample's reward."""
    if bool((loss_mask.sum(dim=1) == 0).any()):
        raise ValueError("a sample has no trained token to carry its reward")
    columns = torch.arange(loss_mask.shape[1]).expand_as(loss_mask)
    last = torch.where(loss_mask > 0, columns, -1).max(dim=1).values
    return (columns == last.unsqueeze(1)).to(loss_mask.dtype)


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along each row (padding carries reward 0, so it adds nothing)."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns


def masked_whiten(values: Tensor, mask: Tensor, all_reduce: AllReduce | None = None) -> Tensor:
    """``(values - mean) / sqrt(var + eps)`` with the mean and unbiased variance of the masked values over every
    rank (miles' distributed_masked_whiten)."""
    mask = mask.to(values.dtype)
    stats = torch.stack([(values * mask).sum(), (values.square() * mask).sum(), mask.sum()]).double()
    if all_reduce is not None:
        all_reduce(stats)
    total, total_sq, count = stats.tolist()
    if count == 0:
        raise ValueError("no trained token to whiten the advantages over")
    mean = total / count
    var = total_sq / count - mean**2
    if count >= 2:
        var *= count / (count - 1)  # Bessel's correction
    return (values - mean) * (var + WHITEN_EPS) ** -0.5
