"""A `model.*` description checked against the checkpoint it describes.

The plan sizes memory, R3 rows, LoRA targets and the engines' context from these fields, while the engines and
the trainer load the checkpoint's own config.json: a description that disagrees with it would plan one model and
run another. The plan checks it when the checkpoint's config is at hand (a tiny model's table, a local folder),
and the executor checks it again once the model is on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_runner.config.schema import ModelConfig
from miles_runner.core.tiny_shapes import TINY_SHAPES

# model.<field> -> the config.json keys that may hold it (architectures spell some differently).
EXACT_FIELDS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": ("hidden_size",),
    "num_attention_heads": ("num_attention_heads",),
    "vocab_size": ("vocab_size",),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "moe_topk": ("num_experts_per_tok", "moe_topk"),
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
}

# DeepSeek sparse attention (DSA) keeps a lightning indexer whose top-k tokens R3's indexer replay records.
DSA_INDEXER_KEYS = ("index_topk", "index_n_heads")


def checkpoint_config(model_path: str, tiny_name: str | None) -> dict[str, Any] | None:
    """The config the checkpoint has, or None where it is not on this machine (a cluster path)."""
    if tiny_name is not None:
        return TINY_SHAPES.get(tiny_name)
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return None
    data: dict[str, Any] = json.loads(config.read_text())
    return data.get("text_config") or data  # multimodal checkpoints nest the language model's config


def shape_mismatches(model: ModelConfig, config: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(model field, described value, checkpoint value) for each field the checkpoint contradicts."""
    found = []
    for name, keys in EXACT_FIELDS.items():
        actual = next((config[key] for key in keys if config.get(key) is not None), 0)
        if getattr(model, name) != actual:
            found.append((name, getattr(model, name), actual))
    has_indexer = any(key in config for key in DSA_INDEXER_KEYS)
    if model.has_dsa_indexer != has_indexer:
        found.append(("has_dsa_indexer", model.has_dsa_indexer, has_indexer))
    if config.get("model_type") and model.family != config["model_type"]:
        found.append(("family", model.family, config["model_type"]))
    limit = config.get("max_position_embeddings")
    if limit and model.max_context_len > limit:
        found.append(("max_context_len", model.max_context_len, limit))
    return found


def describe_mismatches(found: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"model.{name}={described} but the checkpoint has {actual}" for name, described, actual in found)
