"""How to start an engine the contract can run against: the adapter it loads at start and its launch command."""

from __future__ import annotations

import sys
from pathlib import Path

from miles_runner.procs.ports import LOOPBACK

CONTRACT_ADAPTER = "contract_adapter"
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def build_contract_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, seed: int = 0) -> Path:
    """Save a PEFT LoRA adapter for `model_dir` with random (non-zero) A and B, so that it visibly changes
    the model's logprobs."""
    # Imported here: torch, peft and transformers take seconds to load, and only this function needs them.
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGET_MODULES), init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(out_dir)
    return out_dir


def contract_engine_argv(module: str, model_dir: Path, port: int, adapter_path: Path) -> list[str]:
    """The launch command the contract expects: `module` is sglang.launch_server or the embedded engine."""
    return [
        sys.executable,
        "-m",
        module,
        "--model-path",
        str(model_dir),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--enable-lora",
        "--lora-paths",
        f"{CONTRACT_ADAPTER}={adapter_path}",
        "--max-loras-per-batch",
        "4",
        "--enable-return-routed-experts",
    ]
