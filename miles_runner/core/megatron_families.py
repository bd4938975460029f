"""Which model families each Megatron LoRA path can build: one table the plan rules check a recipe against before
anything starts, and the trainer's converter registry is tested against (tests/trainer/megatron)."""

from __future__ import annotations

# lora_mode=raw: the families with an HF <-> megatron-core converter (trainer/megatron/convert.py).
RAW_LORA_FAMILIES = ("qwen2", "qwen3", "qwen3_moe")

# Megatron's fused linears: one LoRA per fused module, so a target set names a whole group or none of it.
FUSED_TARGET_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

# lora_mode=bridge: the HF model types Megatron-Bridge 0.6.2 registers a bridge for
# (megatron/bridge/models/**: `register_bridge(..., model_type=...)`), text models only.
BRIDGE_MODEL_TYPES = (
    "bailing_moe_v2",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v4",
    "ernie4_5_moe",
    "exaone4",
    "exaone4_5",
    "exaone_moe",
    "falcon_h1",
    "gemma",
    "gemma2",
    "gemma3",
    "gemma4",
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "gpt_oss",
    "hy_v3",
    "kimi_k2",
    "llama",
    "mimo",
    "mimo_v2_flash",
    "minimax_m2",
    "mistral3",
    "nemotron",
    "nemotron_h",
    "olmoe",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
    "qwen3_next",
    "step3p5",
    "step3p7",
)

# model.family names that differ from the HF model type.
FAMILY_MODEL_TYPES = {"glm5": "glm_moe_dsa"}


def hf_model_type(family: str) -> str:
    return FAMILY_MODEL_TYPES.get(family, family)
