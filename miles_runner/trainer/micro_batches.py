"""How a step's rows are split into micro-batches (the forward/backward units).

Fixed (``micro_batch_size`` samples each, in order), or under ``trainer.use_dynamic_batch_size`` by a token
budget (``max_tokens_per_gpu``): samples go first-fit into bins of at most that many tokens (miles counts its
micro-batches the same way), a sample longer than the budget alone in its bin. FSDP ranks must run the same number
of forwards, so a rank with fewer bins than another splits its fullest bins until the counts agree. Under the
budget a micro-batch is also cut to its own longest sample, so the budget bounds the tokens a forward holds
(rows are right-padded: the cut changes no value). The loss normalizer is fixed per step, so the split never
changes the gradient.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from miles_runner.trainer.logprobs import TokenBatch, token_log_probs


def plan_micro_batches(lengths: list[int], *, size: int, max_tokens: int = 0, count: int = 0) -> list[list[int]]:
    """Row indices of each micro-batch: ``size`` rows each, or (``max_tokens`` > 0) first-fit token bins, split
    further to at least ``count`` bins."""
    if max_tokens <= 0:
        return [list(range(i, min(i + size, len(lengths)))) for i in range(0, len(lengths), size)]
    bins = first_fit(lengths, max_tokens)
    while len(bins) < min(count, len(lengths)):
        fullest = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        rows = bins.pop(fullest)
        bins[fullest:fullest] = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return bins


def agreed_micro_batches(lengths: list[int], *, size: int, max_tokens: int = 0, world_size: int = 1) -> list[list[int]]:
    """`plan_micro_batches` on a rank whose peers must run as many forwards (every rank's collectives pair up
    forward by forward): under a token budget every rank splits into as many bins as the rank that needs the
    most. Collective when `world_size` > 1 and a budget is set."""
    split = plan_micro_batches(lengths, size=size, max_tokens=max_tokens)
    if max_tokens and world_size > 1:
        count = torch.tensor(len(split))
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        split = plan_micro_batches(lengths, size=0, max_tokens=max_tokens, count=int(count))
    return split


def first_fit(lengths: list[int], max_tokens: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for row, length in enumerate(lengths):
        slot = next((b for b, load in enumerate(loads) if load + length <= max_tokens), None)
        if slot is None:
            bins.append([row])
            loads.append(length)
        else:
            bins[slot].append(row)
            loads[slot] += length
    return bins


def row_lengths(batch: TokenBatch) -> list[int]:
    return [int(n) for n in batch.attention_mask.sum(dim=1)]


def cut_columns(batch: TokenBatch, width: int) -> TokenBatch:
    """The batch's first ``width`` token columns (``width - 1`` per-token columns); itself at full width."""
    if width == batch.input_ids.shape[1]:
        return batch
    routed = batch.routed_experts
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[:, :width],
        attention_mask=batch.attention_mask[:, :width],
        loss_mask=batch.loss_mask[:, : width - 1],
        rollout_log_probs=batch.rollout_log_probs[:, : width - 1],
        routed_experts=None if routed is None else routed[:, :width],
    )


def token_columns(values: Tensor | None, width: int) -> Tensor | None:
    """Per-token ``[B, L - 1]`` values cut like ``cut_columns``; per-sample ``[B]`` values unchanged."""
    return values if values is None or values.dim() == 1 else values[:, : width - 1]


def micro_batched_log_probs(
    net, batch: TokenBatch, micro_batches: list[list[int]], *, temperature: float, cut: bool
) -> Tensor:
    """``[B, L - 1]`` log-probs of the batch, one forward per micro-batch (rows of `batch`); `cut`: each forward
    holds its longest row's columns only (the token budget). A micro-batch without rows still runs its forward:
    the collectives inside pair up with the other ranks'."""
    out = torch.zeros(batch.loss_mask.shape)
    for rows in micro_batches:
        part = batch.select(torch.tensor(rows, dtype=torch.long))
        width = max(row_lengths(part), default=1) if cut else part.input_ids.shape[1]
        log_probs, _ = token_log_probs(net, cut_columns(part, width), temperature=temperature)
        if rows:
            out[rows, : width - 1] = log_probs
    return out
