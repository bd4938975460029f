"""Rollout routing replay (R3) in training: each MoE layer routes every token to the experts the rollout chose.

Alignment (the off-by-one). A sample's ``rollout_routed_experts`` is int32 ``(len(tokens) - 1, num_layers,
top_k)``, as SGLang returns it: row ``i`` holds the experts that processed token ``i`` in the rollout's forward,
whose output predicts token ``i + 1``. The last token was sampled but never forwarded, so it has no row. In a
packed batch (trainer/logprobs.py) row ``i`` therefore goes to input position ``i``, the position whose logits
give log-prob column ``i``. The last token and the padding have no row (``-1`` here): they keep the trainer's own
routing, which nothing reads (attention is causal, and their logits are never scored).

Gate weights, as Megatron's ``RouterReplay`` (``REPLAY_FORWARD``: ``scores.gather(1, top_indices)``) and miles'
FSDP replay do: a softmax of the trainer's own router logits over *all* experts, gathered at the replayed
experts, renormalised over them when the model normalises its top-k (HF ``norm_topk_prob``). The router still
gets gradients through those weights; only the choice of experts is the rollout's.

A sample without rows, or with rows that cannot be its routing (count, shape, expert ids), is a ValueError naming
the sample and the row, never a silent fall back to the trainer's own routing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from miles_runner.models.moe_routing import RoutingLayout, moe_routers

NO_ROW = -1  # positions without a rollout row: the last token and padding


@dataclass
class ReplayStats:
    """Tokens replayed, and how many of them the trainer's own router would have sent elsewhere in any layer."""

    tokens: int = 0
    differing: int = 0

    @property
    def diff_frac(self) -> float:
        return self.differing / self.tokens if self.tokens else 0.0


def sample_label(index: int, sample: Any) -> str:
    """``sample 3 (prompt 12, adapter count)``: the index in the batch, and what its metadata says it is."""
    metadata = getattr(sample, "metadata", None) or {}
    known = [f"{key.replace('_index', '')} {metadata[key]}" for key in ("prompt_index", "adapter") if key in metadata]
    return f"sample {index}" + (f" ({', '.join(known)})" if known else "")


def check_routed_experts(samples: Sequence[Any], layout: RoutingLayout | None) -> None:
    """Every sample carries the rollout's routing for each of its tokens but the last (None: replay is off)."""
    if layout is None:
        return
    for index, sample in enumerate(samples):
        _check_sample(sample_label(index, sample), sample, layout)


def _check_sample(label: str, sample: Any, layout: RoutingLayout) -> None:
    rows = sample.rollout_routed_experts
    expected = (len(sample.tokens) - 1, layout.num_layers, layout.top_k)
    if rows is None:
        raise ValueError(
            f"{label} has no rollout_routed_experts: rollout.routing_replay=true trains with the rollout's routing "
            "of every token (the engine needs --enable-return-routed-experts and the request return_routed_experts)"
        )
    if not isinstance(rows, np.ndarray) or rows.ndim != 3 or rows.shape[1:] != expected[1:]:
        shape = rows.shape if isinstance(rows, np.ndarray) else type(rows).__name__
        raise ValueError(
            f"{label}: rollout_routed_experts has shape {shape}, expected (rows, layers, top_k) = "
            f"(len(tokens) - 1, {layout.num_layers}, {layout.top_k})"
        )
    if rows.shape[0] != expected[0]:
        have, need = rows.shape[0], expected[0]
        gap = f"tokens {have}..{need - 1} have no row" if have < need else f"rows {need}..{have - 1} have no token"
        raise ValueError(
            f"{label}: rollout_routed_experts has {have} rows for {len(sample.tokens)} tokens ({gap}); row i is "
            f"token i's routing, so a sample needs len(tokens) - 1 = {need} rows"
        )
    moe = rows[:, list(layout.moe_layers), :]
    bad = (moe < 0) | (moe >= layout.num_experts)
    if bad.any():
        row, layer, _ = np.argwhere(bad)[0]
        raise ValueError(
            f"{label}: row {row} layer {layout.moe_layers[layer]} routes to expert "
            f"{moe[row, layer].tolist()}, outside [0, {layout.num_experts})"
        )
    ordered = np.sort(moe, axis=-1)
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(axis=-1)
    if repeated.any():
        row, layer = np.argwhere(repeated)[0]
        raise ValueError(
            f"{label}: row {row} layer {layout.moe_layers[layer]} names an expert twice "
            f"{moe[row, layer].tolist()}: not a top-{layout.top_k} routing"
        )


def routed_rows(samples: Sequence[Any], width: int, layout: RoutingLayout) -> Tensor:
    """The batch's routing, int32 ``[B, width, num_layers, top_k]``: sample rows at their token positions, NO_ROW
    elsewhere (checked first, so a misaligned row is an error here too)."""
    check_routed_experts(samples, layout)
    out = torch.full((len(samples), width, layout.num_layers, layout.top_k), NO_ROW, dtype=torch.int32)
    for index, sample in enumerate(samples):
        rows = sample.rollout_routed_experts
        out[index, : len(rows)] = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int32))
    return out


def differs(own: Tensor, replayed: Tensor) -> Tensor:
    """Per token ``[N]``: whether the two ``[N, top_k]`` expert sets differ (order within the top-k is ignored)."""
    return (own.sort(dim=-1).values != replayed.sort(dim=-1).values).any(dim=-1)


def replaying(model: torch.nn.Module, routes: Tensor | None, stats: ReplayStats | None = None):
    """A context in which every forward of the model routes as ``routes`` ``[B, L, num_layers, top_k]`` say (for
    ``input_ids`` ``[B, L]``); a no-op for None. Hold it through the backward too when layers are recomputed
    there (activation checkpointing), so the recompute routes as the forward did; a replay of the same routes
    inside it is a no-op. ``stats`` adds the replayed tokens and those the trainer would have routed elsewhere."""
    if routes is None:
        return nullcontext()
    own = getattr(model, "replay_routing", None)  # a model that routes its own way (the Megatron trainer's)
    return own(routes, stats) if own is not None else _replaying(model, routes, stats)


@contextmanager
def _replaying(model: torch.nn.Module, routes: Tensor, stats: ReplayStats | None) -> Iterator[None]:
    routers = moe_routers(model)
    if not routers:
        raise ValueError("routing replay: the model has no router to replay (a dense model)")
    active = routers[0][1].__dict__.get("forward")
    if isinstance(active, _ReplayedForward):
        if active.routes is not routes:
            raise ValueError("routing replay: a forward with other routes inside a replay of this batch")
        yield
        return
    batch, width, _, top_k = routes.shape
    has_row = routes[:, :, routers[0][0], 0].reshape(-1) != NO_ROW
    differing = torch.zeros(batch * width, dtype=torch.bool)
    for layer, router in routers:
        router.forward = _ReplayedForward(router, routes, routes[:, :, layer, :].reshape(-1, top_k), differing)
    try:
        yield
    finally:
        for _, router in routers:
            del router.forward  # the class's forward again
    if stats is not None:
        stats.tokens += int(has_row.sum())
        stats.differing += int((differing & has_row).sum())


@dataclass(frozen=True, eq=False)
class _ReplayedForward:
    """The HF Qwen3-MoE router's forward with the choice of experts taken from ``target`` ``[N, top_k]``."""

    router: torch.nn.Module
    routes: Tensor  # the whole batch's, to recognise a nested replay
    target: Tensor  # this layer's rows, flattened like the router's input
    differing: Tensor  # [N] bool: where the router's own top-k is another set (any layer)

    def __call__(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        router = self.router
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        if self.target.shape != own.shape:
            raise ValueError(
                f"routing replay: {tuple(self.target.shape)} replay rows for a forward of "
                f"{tuple(own.shape)} (tokens, top_k)"
            )
        wanted = self.target.to(own.device, torch.long)
        replayed = torch.where(wanted[:, :1] == NO_ROW, own, wanted)
        weights = probs.gather(1, replayed)
        if router.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        self.differing.logical_or_(differs(own, replayed).cpu())
        return logits, weights.to(logits.dtype), replayed
