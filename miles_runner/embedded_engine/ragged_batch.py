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

# One layer's cached tensors for one row, each ``(heads, tokens, dim)``: a standard attention layer's keys and values;
# an MLA layer's latent and rope key (one head each, widths of their own) and, with a DSA indexer, its keys.
LayerCache = tuple[torch.Tensor, ...]


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

    def stack_cache(self, caches: list[list[LayerCache] | None]) -> list[LayerCache] | None:
        """Left-pad per-row caches into batch tensors: each cached tensor of a layer, ``(heads, len, dim)`` with its
        own heads and dim, becomes ``(B, heads, C, dim)``, one padding op per tensor, not one copy per row (rows
        without a cache are all pad). None when no row has a cache: the forward starts from an empty one."""
        if self.cache_width == 0:
            return None
        # Any row with a cache shows every layer's tensors (an MLA layer's differ from a standard one's).
        template = next(cache for cache, c in zip(caches, self.cache_lens, strict=True) if c and cache is not None)

        def padded(layer: int, part: int) -> torch.Tensor:
            like = template[layer][part]
            empty = like.new_zeros(0, like.shape[0], like.shape[2])
            rows = [
                cache[layer][part].transpose(0, 1) if c and cache is not None else empty
                for cache, c in zip(caches, self.cache_lens, strict=True)
            ]  # (len, heads, dim) each
            batch = pad_sequence(rows, batch_first=True, padding_side="left")  # (B, max len, heads, dim)
            return batch.transpose(1, 2)

        return [tuple(padded(layer, part) for part in range(len(states))) for layer, states in enumerate(template)]

    def split_cache(self, layer_states: list[LayerCache], row: int) -> list[LayerCache]:
        """Row ``row``'s cache after the forward: its old real columns plus its new real columns. Where they are
        adjacent (no padding between: every decode step, every first prefill) it is a view, not a copy."""
        cw, c, pad = self.cache_width, self.cache_lens[row], self.new_pad(row)
        if pad == 0 or c == 0:
            real = slice(cw - c, None) if pad == 0 else slice(cw + pad, None)
            return [tuple(t[row, :, real] for t in states) for states in layer_states]
        old, new = slice(cw - c, cw), slice(cw + pad, None)
        return [tuple(torch.cat([t[row, :, old], t[row, :, new]], dim=1) for t in states) for states in layer_states]

    def new_rows(self, per_token: torch.Tensor, row: int) -> torch.Tensor:
        """The real new-token part of a ``(B, N, ...)`` tensor for one row."""
        return per_token[row, self.new_pad(row) :]
