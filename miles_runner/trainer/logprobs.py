"""Per-token log-probabilities of response tokens for a batch of samples.

Samples are right-padded into ``[B, L]``; every per-token tensor is then ``[B, L - 1]``, aligned with the
*predicted* token ``input_ids[:, 1:]``: response token ``j`` of a sample with prompt length ``P`` sits at
column ``P - 1 + j``. ``loss_mask`` is 1 exactly on trained response tokens, so prompt and padding columns
never reach the loss. Logits are divided by the rollout temperature, as the engine's sampling logprobs are.

With routing replay (R3) the batch also carries the rollout's expert choices per input position
(``routed_experts``, see trainer/routing_replay.py for which token's routing sits in which row), and every
forward of that batch routes with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from miles_runner.core.sglang_protocol import logprob_temperature
from miles_runner.models.moe_routing import RoutingLayout
from miles_runner.trainer.routing_replay import ReplayStats, replaying, routed_rows


class TrainingSample(Protocol):
    """What a trainer reads from a sample (``miles_runner.session.samples.Sample`` satisfies it)."""

    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    rollout_routed_experts: np.ndarray | None  # (len(tokens) - 1, num_layers, top_k), read under routing replay
    reward: float | None
    metadata: dict[str, Any]  # multi-LoRA: "slot", the engine slot of the sample's adapter


@dataclass(frozen=True)
class TokenBatch:
    input_ids: Tensor  # [B, L]
    attention_mask: Tensor  # [B, L]
    loss_mask: Tensor  # [B, L-1] float
    rollout_log_probs: Tensor  # [B, L-1], 0 where absent
    has_rollout_log_probs: bool  # every sample carried its sampling log-probs
    routed_experts: Tensor | None = None  # [B, L, num_layers, top_k] int32 under routing replay, else None

    def select(self, rows: slice | Tensor) -> TokenBatch:
        routed = None if self.routed_experts is None else self.routed_experts[rows]
        return TokenBatch(
            self.input_ids[rows],
            self.attention_mask[rows],
            self.loss_mask[rows],
            self.rollout_log_probs[rows],
            self.has_rollout_log_probs,
            routed,
        )


def _check(sample: TrainingSample) -> None:
    n = sample.response_length
    if not 0 < n < len(sample.tokens):
        raise ValueError(f"response_length {n} must be in (0, {len(sample.tokens)})")
    if len(sample.loss_mask) != n or (sample.rollout_log_probs and len(sample.rollout_log_probs) != n):
        raise ValueError(f"loss_mask and rollout_log_probs must have response_length={n} entries")


def pack_samples(samples: Sequence[TrainingSample], pad_id: int, routing: RoutingLayout | None = None) -> TokenBatch:
    """Right-padded tensors of the samples; with a `routing` layout (replay on), their rollout routing too."""
    for sample in samples:
        _check(sample)
    width = max(len(s.tokens) for s in samples)
    input_ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width - 1))
    rollout = torch.zeros((len(samples), width - 1))
    for row, s in enumerate(samples):
        input_ids[row, : len(s.tokens)] = torch.tensor(s.tokens)
        attention[row, : len(s.tokens)] = 1
        start = len(s.tokens) - s.response_length - 1
        loss_mask[row, start : start + s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float)
        if s.rollout_log_probs:
            rollout[row, start : start + s.response_length] = torch.tensor(s.rollout_log_probs)
    routed = None if routing is None else routed_rows(samples, width, routing)
    return TokenBatch(input_ids, attention, loss_mask, rollout, all(s.rollout_log_probs for s in samples), routed)


def token_log_probs(
    model,
    batch: TokenBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    replay_stats: ReplayStats | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``input_ids[:, 1:]`` (and the per-position entropy when asked), ``[B, L-1]``; routed as
    the rollout was when the batch carries routing (``replay_stats`` then counts the replayed tokens)."""
    with replaying(model, batch.routed_experts, replay_stats):
        output = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logits = output.logits[:, :-1].float()
    log_softmax = (logits / logprob_temperature(temperature)).log_softmax(dim=-1)  # temperature 0: greedy, as 1.0
    targets = batch.input_ids[:, 1:].unsqueeze(-1).to(logits.device)
    log_probs = log_softmax.gather(-1, targets).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(dim=-1) if with_entropy else None
    # A model on a GPU: the loss works on the batch's (host) tensors; only [B, L-1] values come back.
    home = batch.input_ids.device
    return log_probs.to(home), None if entropy is None else entropy.to(home)


@torch.no_grad()
def sequence_log_probs(model, token_ids: Sequence[int]) -> list[float]:
    """The raw model's (temperature 1.0) logprob of each token of one sequence after its first: the push probe."""
    ids = torch.tensor([list(token_ids)])
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, ids[0, 1:].unsqueeze(-1).to(logits.device)).squeeze(-1).tolist()


def response_values(values: Tensor, samples: Sequence[TrainingSample]) -> list[list[float]]:
    """Per-sample lists of the response positions of a ``[B, L-1]`` tensor (e.g. the trainer's logprobs)."""
    out = []
    for row, s in enumerate(samples):
        start = len(s.tokens) - s.response_length - 1
        out.append(values[row, start : start + s.response_length].tolist())
    return out
