"""How the Megatron trainer feeds a right-padded batch to the model: the plan's ``trainer.parallel.qkv_format``.

- ``thd``: the samples' real tokens are packed back to back (first fit, rows of up to ``PACKED_ROW_TOKENS``), and
  attention is block-diagonal (a token reads only earlier tokens of its own sample), as Megatron's packed (THD)
  sequences are. The local layer spec has no varlen kernel, so the blocks are an explicit mask, quadratic in a
  row's width: hence rows of bounded width rather than one row per micro-batch. RoPE needs no per-sample offsets
  because a block only ever compares positions within itself (RoPE scores depend on the distance alone).
- ``bshd``: the rows as they are, right-padded.

Either way every rank of the world forwards the same shape: the MoE token dispatcher all-gathers tokens over
TP x EP (equal sizes), and sequence parallelism splits the sequence over TP, so lengths (and, padded, row counts)
are agreed with a MAX all-reduce first. The caller sees HF's interface (``.logits [B, L, V]``), and routing
replay (R3) rows are laid out the same way as the tokens they route.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from miles_runner.trainer.megatron.model import MegatronCausalLM, replay_routing
from miles_runner.trainer.micro_batches import first_fit
from miles_runner.trainer.routing_replay import NO_ROW, ReplayStats

NO_SEGMENT = -1  # padding in a packed row
# Packed rows hold up to this many tokens: the local layer spec attends through an explicit mask, quadratic in a
# row's width, so one row per micro-batch would cost (batch tokens)^2 (bench/megatron_step_time.py).
PACKED_ROW_TOKENS = 256


def agreed(*sizes: int) -> list[int]:
    """Each size maxed over the world (a no-op alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(sizes)
    values = torch.tensor(sizes)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Packing:
    """Where each sample's tokens sit in the packed rows: ``flat [B, L]`` is the position in the flattened
    ``[rows, width]`` packed batch, -1 at padding."""

    rows: int
    width: int
    flat: Tensor

    @classmethod
    def of(cls, attention_mask: Tensor, tp: int) -> Packing:
        """Samples first-fit into rows of at most PACKED_ROW_TOKENS tokens (a longer sample alone in its row), the
        row count and width agreed over the world."""
        lengths = [int(n) for n in attention_mask.sum(dim=1)]
        bins = first_fit(lengths, max([PACKED_ROW_TOKENS, *lengths]))
        used = max((sum(lengths[r] for r in b) for b in bins), default=1)
        rows, width = agreed(max(len(bins), 1), round_up(max(used, 1), tp))
        start = torch.zeros(len(lengths), dtype=torch.long)
        for row, members in enumerate(bins):
            offset = row * width
            for r in members:
                start[r], offset = offset, offset + lengths[r]
        columns = torch.arange(attention_mask.shape[1])
        flat = torch.where(attention_mask.cpu().bool(), start[:, None] + columns[None, :], -1)
        return cls(rows, width, flat.to(attention_mask.device))

    def pack(self, values: Tensor, fill: int | float) -> Tensor:
        """``values [B, L, ...]`` -> ``[rows, width, ...]``, ``fill`` where no token sits."""
        out = torch.full((self.rows * self.width, *values.shape[2:]), fill, dtype=values.dtype, device=values.device)
        real = self.flat.to(values.device) >= 0
        out[self.flat.to(values.device)[real]] = values[real]
        return out.view(self.rows, self.width, *values.shape[2:])

    def segments(self) -> Tensor:
        """``[rows, width]``: the sample each packed token comes from, NO_SEGMENT where none does."""
        owners = torch.arange(self.flat.shape[0], device=self.flat.device)[:, None].expand_as(self.flat)
        return self.pack(owners.unsqueeze(-1), NO_SEGMENT).squeeze(-1)

    def unpack(self, values: Tensor) -> Tensor:
        """The inverse of ``pack`` for ``[rows, width, ...]`` outputs: ``[B, L, ...]``, zero at padding."""
        flat_values = values.reshape(self.rows * self.width, *values.shape[2:])
        out = flat_values.new_zeros((*self.flat.shape, *values.shape[2:]))
        real = self.flat >= 0
        out[real] = flat_values[self.flat[real]]
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
        packing = Packing.of(attention_mask, self.model.layout.tp)
        routes = None if self._routes is None else packing.pack(self._routes[0].to(input_ids.device), NO_ROW).cpu()
        with self._replay(routes):
            out = self.model(packing.pack(input_ids, 0), segment_ids=packing.segments())
        return SimpleNamespace(logits=packing.unpack(out.logits))

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
        if routes is None or self._routes is None:
            return nullcontext()
        return replay_routing(self.model, routes, self._routes[1])

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
