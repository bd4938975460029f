"""How the Megatron trainer feeds a right-padded batch to the model: the plan's ``trainer.parallel.qkv_format``.

- ``thd``: the rows' real tokens are packed back to back into one sequence, and attention is block-diagonal
  (a token reads only earlier tokens of its own sample), as Megatron's packed (THD) sequences are. No padding
  token is computed. The local layer spec has no varlen kernel, so the blocks are an explicit mask; RoPE needs no
  per-sample offsets because a block only ever compares positions within itself (RoPE scores depend on the
  distance alone).
- ``bshd``: the rows as they are, right-padded.

Either way every rank of the world forwards the same shape: the MoE token dispatcher all-gathers tokens over
TP x EP (equal sizes), and sequence parallelism splits the sequence over TP, so lengths (and, padded, row counts)
are agreed with a MAX all-reduce first. The caller sees HF's interface (``.logits [B, L, V]``), and routing
replay (R3) rows are laid out the same way as the tokens they route.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from miles_runner.trainer.megatron.model import MegatronCausalLM, replay_routing
from miles_runner.trainer.routing_replay import NO_ROW, ReplayStats

NO_SEGMENT = -1  # padding in a packed row


def agreed(*sizes: int) -> list[int]:
    """Each size maxed over the world (a no-op alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(sizes)
    values = torch.tensor(sizes)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@torch.no_grad()
def segments_of(attention_mask: Tensor, width: int) -> Tensor:
    """``[1, width]``: the row each packed token comes from, NO_SEGMENT past the last real token."""
    lengths = attention_mask.sum(dim=1)
    segments = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    return F.pad(segments, (0, width - len(segments)), value=NO_SEGMENT).unsqueeze(0)


def pack(values: Tensor, attention_mask: Tensor, width: int, fill: int | float) -> Tensor:
    """``values [B, L, ...]`` -> ``[1, width, ...]``: each row's real positions back to back, then ``fill``."""
    real = values[attention_mask.bool()]
    pad = torch.full((width - real.shape[0], *real.shape[1:]), fill, dtype=values.dtype, device=values.device)
    return torch.cat([real, pad]).unsqueeze(0)


def unpack(values: Tensor, attention_mask: Tensor) -> Tensor:
    """The inverse of ``pack`` for ``[1, width, ...]`` outputs: ``[B, L, ...]``, zero at padding."""
    out = values.new_zeros((*attention_mask.shape, *values.shape[2:]))
    mask = attention_mask.bool()
    out[mask] = values[0, : int(mask.sum())]
    return out


class CausalLMForLoss(torch.nn.Module):
    """The Megatron model behind the shared loss code's HF-style call, in the plan's qkv format."""

    def __init__(self, model: MegatronCausalLM, *, qkv_format: str) -> None:
        super().__init__()
        if qkv_format not in ("thd", "bshd"):
            raise ValueError(f"trainer.parallel.qkv_format must be thd or bshd, not {qkv_format!r}")
        self.model, self.qkv_format = model, qkv_format
        self._routes: tuple[Tensor, ReplayStats | None] | None = None

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        device = next(self.model.parameters()).device  # a GPU trainer: the host batch goes to the model's device
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        if self.qkv_format == "thd":
            return self._packed(input_ids, attention_mask)
        return self._padded(input_ids, attention_mask)

    def _packed(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        (width,) = agreed(round_up(max(int(attention_mask.sum()), 1), self.model.layout.tp))
        segments = segments_of(attention_mask, width)
        routes = None if self._routes is None else pack(self._routes[0], attention_mask.cpu(), width, NO_ROW)
        with self._replay(routes):
            out = self.model(pack(input_ids, attention_mask, width, 0), segment_ids=segments)
        return SimpleNamespace(logits=unpack(out.logits, attention_mask))

    def _padded(self, input_ids: Tensor, attention_mask: Tensor) -> SimpleNamespace:
        rows, width = input_ids.shape
        agreed_rows, agreed_width = agreed(max(rows, 1), round_up(width, self.model.layout.tp))
        grow = (0, agreed_width - width, 0, agreed_rows - rows)
        routes = None
        if self._routes is not None:
            routes = F.pad(self._routes[0], (0, 0, 0, 0, *grow), value=NO_ROW)  # stays on the host, like the rows
        with self._replay(routes):
            out = self.model(F.pad(input_ids, grow), F.pad(attention_mask, grow))
        return SimpleNamespace(logits=out.logits[:rows, :width])

    def _replay(self, routes: Tensor | None):
        return nullcontext() if routes is None else replay_routing(self.model, routes, self._routes[1])

    @contextmanager
    def replay_routing(self, routes: Tensor | None, stats: ReplayStats | None = None) -> Iterator[None]:
        """trainer/routing_replay.replaying for this model: forwards inside route as ``routes [B, L, layers,
        top_k]`` (the batch's order) say, laid out as each forward packs or pads its tokens."""
        if routes is None:
            yield
            return
        if self._routes is not None:  # inside a replay: the same routes are a no-op, the outer one counts them
            if self._routes[0] is not routes:
                raise ValueError("routing replay: a forward with other routes inside a replay of this batch")
            yield
            return
        self._routes = (routes, stats)
        try:
            yield
        finally:
            self._routes = None
