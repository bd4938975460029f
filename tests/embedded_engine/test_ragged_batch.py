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
    stacked = layout.stack_cache(caches, LAYERS, (HEADS, DIM))
    for (keys, values), (want_keys, want_values) in zip(stacked, reference_stack(layout, caches), strict=True):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_no_row_has_a_cache_gives_empty_batch_caches():
    layout = RaggedLayout(cache_lens=[0, 0], new_lens=[3, 2])
    stacked = layout.stack_cache([None, None], LAYERS, (HEADS, DIM))
    assert [tuple(k.shape) for k, _ in stacked] == [(2, HEADS, 0, DIM)] * LAYERS


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
