"""Layout of one forward pass over requests with different cache lengths and different new-token counts.

Each row keeps its own KV cache. For a forward the caches are left-padded to a common length ``C`` and the
new tokens are left-padded to a common length ``N``, so every row's last real token sits in the last column
(``logits[:, -1]`` is each row's next-token distribution)::

    row i:  [pad .. pad | cache_i (c_i) | pad .. pad | new_i (n_i)]
             <-------- C columns ------> <------ N columns ----->

The 4-D mask lets every real query see its own real keys (causally) and never a pad; pad queries see
only themselves, so no attention row is empty (an empty row would turn into NaN and leak through the MoE).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence


@dataclass(frozen=True)
class RaggedLayout:
    cache_lens: list[int]
    new_lens: list[int]

    @property
    def cache_width(self) -> int:
        return max(self.cache_lens)

    @property
    def new_width(self) -> int:
        return max(self.new_lens)

    def new_pad(self, row: int) -> int:
        return self.new_width - self.new_lens[row]

    def input_ids(self, new_tokens: list[list[int]], pad_id: int) -> torch.Tensor:
        width = self.new_width
        return torch.tensor([[pad_id] * (width - len(t)) + list(t) for t in new_tokens], dtype=torch.long)

    def position_ids(self) -> torch.Tensor:
        rows = []
        for c, n in zip(self.cache_lens, self.new_lens, strict=True):
            rows.append([0] * (self.new_width - n) + list(range(c, c + n)))
        return torch.tensor(rows, dtype=torch.long)

    def attention_mask(self) -> torch.Tensor:
        """Additive float ``(B, 1, N, C + N)`` mask: 0 where a query may attend to a key, the dtype's minimum
        elsewhere (torch's CPU SDPA is many times faster with a float mask than with a boolean one)."""
        allowed = self._allowed()
        return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)

    def _allowed(self) -> torch.Tensor:
        cw, nw = self.cache_width, self.new_width
        key_cols = torch.arange(cw + nw)
        valid_keys = []
        for row, c in enumerate(self.cache_lens):
            in_cache = (key_cols >= cw - c) & (key_cols < cw)
            in_new = key_cols >= cw + self.new_pad(row)
            valid_keys.append(in_cache | in_new)
        valid = torch.stack(valid_keys)[:, None, None, :]  # (B, 1, 1, K)
        query_cols = (cw + torch.arange(nw))[:, None]  # (N, 1)
        causal = key_cols[None, :] <= query_cols  # (N, K)
        itself = key_cols[None, :] == query_cols
        return (valid & causal[None, None]) | itself[None, None]

    def stack_cache(self, caches: list[list[tuple[torch.Tensor, torch.Tensor]] | None], num_layers: int, like):
        """Left-pad per-row caches (each ``(heads, len, dim)`` per layer) into ``(k, v)`` batch tensors
        ``(B, heads, C, dim)``: one padding op per tensor, not one copy per row (rows without a cache are all pad)."""
        heads, dim = like
        empty = torch.zeros(0, heads, dim)

        def padded(layer: int, part: int) -> torch.Tensor:
            rows = [
                cache[layer][part].transpose(0, 1) if c and cache is not None else empty
                for cache, c in zip(caches, self.cache_lens, strict=True)
            ]  # (len, heads, dim) each
            batch = pad_sequence(rows, batch_first=True, padding_side="left")  # (B, max len, heads, dim)
            return batch.transpose(1, 2)

        if self.cache_width == 0:
            return [(torch.zeros(len(caches), heads, 0, dim),) * 2 for _ in range(num_layers)]
        return [(padded(layer, 0), padded(layer, 1)) for layer in range(num_layers)]

    def split_cache(self, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], row: int):
        """Row ``row``'s cache after the forward: its old real columns plus its new real columns. Where they are
        adjacent (no padding between: every decode step, every first prefill) it is a view, not a copy."""
        cw, c, pad = self.cache_width, self.cache_lens[row], self.new_pad(row)
        if pad == 0 or c == 0:
            real = slice(cw - c, None) if pad == 0 else slice(cw + pad, None)
            return [(k[row, :, real], v[row, :, real]) for k, v in layer_kv]
        old, new = slice(cw - c, cw), slice(cw + pad, None)
        return [
            (torch.cat([k[row, :, old], k[row, :, new]], dim=1), torch.cat([v[row, :, old], v[row, :, new]], dim=1))
            for k, v in layer_kv
        ]

    def new_rows(self, per_token: torch.Tensor, row: int) -> torch.Tensor:
        """The real new-token part of a ``(B, N, ...)`` tensor for one row."""
        return per_token[row, self.new_pad(row) :]
