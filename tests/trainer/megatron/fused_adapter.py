"""A PEFT adapter that Megatron's fused projections can hold exactly: random A and B (peft's
init_lora_weights=False, B scaled down to a small but visible change), q/k/v sharing one lora_A (megatron fuses
them into linear_qkv, whose LoRA has one A). Engines load the folder as any peft adapter; the Megatron trainer
through adapters.init_path."""

from __future__ import annotations

from pathlib import Path

import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def save_fused_adapter(model_path: str | Path, out: Path, *, rank: int = 4, alpha: float = 8, seed: int = 3) -> Path:
    """The adapter saved by peft in `out` (an attention LoRA of `rank`, `alpha` on the model); returns `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=ATTENTION, init_lora_weights=False)
    model = get_peft_model(base, config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in params.items():
            if "lora_B" in name:
                param.mul_(0.1)  # a visible but small change to the outputs
            if ".k_proj.lora_A" in name or ".v_proj.lora_A" in name:  # megatron fuses q/k/v: one shared A
                param.copy_(params[name.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.")])
    model.save_pretrained(out)
    return out
