"""The transformers cache object of one forward, built from the batch's stacked caches and read back after it.

Every layer's cache travels as a tuple of tensors ``(B, heads, tokens, dim)`` (ragged_batch.LayerCache), each with
its own heads and dim, so one code path pads, splits and slices them all:

- a standard attention layer: its keys and values, ``(kv_heads, head_dim)`` both;
- an MLA layer (GLM-5, DeepSeek): what transformers caches in their place, the normalised KV latent
  ``(1, kv_lora_rank)`` and the rotated rope key ``(1, qk_rope_head_dim)``;
- a layer with a DSA indexer: a third tensor, the indexer's keys. transformers keeps them ``(B, tokens, dim)``;
  here they get a head axis of 1, so their tokens sit on the same axis as every other cached tensor's.

The cache object comes from the model's config, as ``generate`` builds it, so each layer is of the class the model
expects (an indexer writes through ``update_indexer``, which only the indexed layers have).
"""

from __future__ import annotations

from typing import Any

from miles_runner.embedded_engine.ragged_batch import LayerCache

# The per-layer state beyond keys and values that a cache layer may hold, each (B, tokens, dim) in transformers.
INDEXER_KEYS = "indexer_keys"


def cache_argument(model: Any) -> str:
    """The name the model's forward takes its cache under: ``cache`` in newer transformers, ``past_key_values`` in
    5.12 (Megatron-Bridge's environment, whose tests load exported adapters into the engine). A cache passed under
    the other name is ignored: the model would build one of its own and the rows' caches would stay empty."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def build_cache(config: Any, stacked: list[LayerCache] | None) -> Any:
    """A fresh cache for `config`'s model, holding `stacked` (None: empty, the first prefill of every row)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    if stacked is not None:
        for layer, states in zip(cache.layers, stacked, strict=True):
            layer.update(states[0], states[1])
            if len(states) > 2:
                layer.update_indexer(states[2].squeeze(1))
    return cache


def read_cache(cache: Any) -> list[LayerCache]:
    """Every layer's cached tensors after a forward, in the order `build_cache` takes them."""
    layers = []
    for layer in cache.layers:
        states: LayerCache = (layer.keys, layer.values)
        indexer_keys = getattr(layer, INDEXER_KEYS, None)
        if indexer_keys is not None:  # a layer that shares another's top-k runs no indexer and caches none
            states += (indexer_keys.unsqueeze(1),)
        layers.append(states)
    return layers
