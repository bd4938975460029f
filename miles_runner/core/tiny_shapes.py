"""The shapes of the embedded tiny models, as Hugging Face config keys, and the tokens their tokenizers add: tables
that the model factory builds from (models/tiny_model.py) and the plan checks a `model.*` description (and a session's
TITO family) against before the model exists."""

from __future__ import annotations

from typing import Any

_COMMON: dict[str, Any] = {
    "vocab_size": 400,  # the embedded byte-level BPE's size, its added tokens included
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
    # GLM-5's architecture in miniature: MLA attention (low-rank query and key-value projections), a DSA lightning
    # indexer, a dense first layer, then routed experts plus a shared expert.
    "tiny-glm5": {
        "model_type": "glm_moe_dsa",
        "vocab_size": _COMMON["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "index_head_dim": 16,
        "index_n_heads": 2,
        # The indexer keeps every token up to the context length: transformers 5.12 (Megatron-Bridge's) and 5.25
        # select differently when it has to drop tokens, and then the two give different logits.
        "index_topk": 2048,
        "max_position_embeddings": 2048,
        # transformers' MLA norms (q_a_layernorm, kv_a_layernorm) always use 1e-6, while Megatron-Bridge gives them
        # rms_norm_eps like every other norm: the same value everywhere keeps the two models alike (with 1e-5 their
        # logits differ by 6e-5).
        "rms_norm_eps": 1e-6,
    },
}

# The tokens each tiny tokenizer adds to its byte-level BPE. The Qwen3 shapes speak ChatML; tiny-glm5 speaks GLM-4.7's
# chat format, as GLM-5 does (what the TITO family glm47 renders with): its role tokens end a turn, and its
# reasoning and tool-call markers are single tokens that decode as text (as in GLM's own tokenizer, where they are not
# special).
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GLM47_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
GLM47_TEXT_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
TINY_TOKENS: dict[str, tuple[str, ...]] = {
    "tiny-moe": CHATML_TOKENS,
    "tiny-dense": CHATML_TOKENS,
    "tiny-glm5": GLM47_SPECIAL_TOKENS + GLM47_TEXT_TOKENS,
}
