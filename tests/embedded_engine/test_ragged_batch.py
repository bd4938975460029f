"""The ragged layout's cache stacking and splitting: the same tensors a row-by-row copy gives, and a row's cache
after a decode step or a first prefill is a view of the batch's (no copy)."""

from __future__ import annotations

import torch

from miles_runner.embedded_engine.ragged_batch import RaggedLayout

HEADS, DIM, LAYERS = 2, 4, 2


def row_cache(length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(HEADS, length, DIM, generator=generator), torch.randn(HEADS, length, DIM, generator=generator))
        for _ in range(LAYERS)
    ]


def reference_stack(layout: RaggedLayout, caches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeros, then each row's cache copied into its last columns."""
    cw = layout.cache_width
    out = []
    for layer in range(LAYERS):
        keys, values = torch.zeros(len(caches), HEADS, cw, DIM), torch.zeros(len(caches), HEADS, cw, DIM)
        for row, cache in enumerate(caches):
            if c := layout.cache_lens[row]:
                keys[row, :, cw - c :], values[row, :, cw - c :] = cache[layer]
        out.append((keys, values))
    return out


def test_stacked_caches_are_left_padded_as_a_row_by_row_copy_would_be():
    layout = RaggedLayout(cache_lens=[5, 0, 3, 5], new_lens=[1, 4, 2, 1])
    caches = [row_cache(5, 1), None, row_cache(3, 2), row_cache(5, 3)]
    stacked = layout.stack_cache(caches)
    for (keys, values), (want_keys, want_values) in zip(stacked, reference_stack(layout, caches), strict=True):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_no_row_has_a_cache_gives_no_batch_cache():
    layout = RaggedLayout(cache_lens=[0, 0], new_lens=[3, 2])
    assert layout.stack_cache([None, None]) is None


def mla_row_cache(length: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """An MLA layer's latent (1 head, 6 wide) and rope key (1 head, 2 wide), then an indexer's keys (1 head, 3 wide)
    on the first layer only, as GLM-5 caches them when the second layer shares the first one's top-k."""
    generator = torch.Generator().manual_seed(seed)
    widths = [(6, 2, 3), (6, 2)]
    return [tuple(torch.randn(1, length, w, generator=generator) for w in layer) for layer in widths]


def test_each_cached_tensor_keeps_its_own_shape_through_stack_and_split():
    layout = RaggedLayout(cache_lens=[4, 0, 2], new_lens=[1, 3, 2])
    caches = [mla_row_cache(4, 1), None, mla_row_cache(2, 2)]
    stacked = layout.stack_cache(caches)
    assert [[tuple(t.shape) for t in layer] for layer in stacked] == [
        [(3, 1, 4, 6), (3, 1, 4, 2), (3, 1, 4, 3)],
        [(3, 1, 4, 6), (3, 1, 4, 2)],
    ]
    # After a forward each tensor has grown by the new width; a row's split is its own columns of every tensor.
    grown = [tuple(torch.cat([t, torch.randn(3, 1, 3, t.shape[-1])], dim=2) for t in layer) for layer in stacked]
    for row, cache in enumerate(caches):
        split = layout.split_cache(grown, row)
        total = layout.cache_lens[row] + layout.new_lens[row]
        assert [[tuple(t.shape) for t in layer] for layer in split] == [
            [(1, total, 6), (1, total, 2), (1, total, 3)],
            [(1, total, 6), (1, total, 2)],
        ]
        if cache is not None:  # the old columns come back unchanged
            for layer, states in enumerate(cache):
                for part, tensor in enumerate(states):
                    assert torch.equal(split[layer][part][:, : tensor.shape[1]], tensor)


def test_split_gives_each_rows_real_columns_and_views_where_they_are_adjacent():
    layout = RaggedLayout(cache_lens=[3, 0, 1], new_lens=[1, 2, 2])  # cache width 3, new width 2
    width = layout.cache_width + layout.new_width
    batch = [(torch.randn(3, HEADS, width, DIM), torch.randn(3, HEADS, width, DIM)) for _ in range(LAYERS)]
    # row 0: its cache, a pad column, its new token (a copy); rows 1 and 2: adjacent columns (views)
    real_columns = {0: [0, 1, 2, 4], 1: [3, 4], 2: [2, 3, 4]}
    for row, columns in real_columns.items():
        split = layout.split_cache(batch, row)
        for (keys, values), (batch_keys, batch_values) in zip(split, batch, strict=True):
            assert torch.equal(keys, batch_keys[row][:, columns]) and torch.equal(values, batch_values[row][:, columns])
            shares = keys.untyped_storage().data_ptr() == batch_keys.untyped_storage().data_ptr()
            assert shares == (row != 0)
