"""The shapes of the embedded tiny models, as Hugging Face config keys: one table that the model factory builds
from (models/tiny_model.py) and the plan checks a `model.*` description against before the model exists."""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 400,  # the embedded byte-level BPE's size (models/tiny_model.TOKENIZER_VOCAB_SIZE)
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 2048,
}

TINY_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-moe": {
        **_COMMON,
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "tiny-dense": {**_COMMON, "model_type": "qwen3"},
}
