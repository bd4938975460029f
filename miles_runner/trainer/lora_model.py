"""The trainable model: an HF causal LM with a peft LoRA adapter built from the plan's AdapterSpec.

Only the adapter's parameters require grad; the base weights are frozen, so the reference policy for the
KL term is the same model under ``model.disable_adapter()``. Adapter tensors use PEFT naming
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), which both ``peft`` and SGLang
(``/load_lora_adapter_from_tensors``, ``--lora-paths``) read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from miles_runner.core.adapters import AdapterSpec

PEFT_ADAPTER = "default"  # peft's internal adapter name; engines serve it under AdapterSpec.lora_name


def lora_config(adapter: AdapterSpec, *, inference_mode: bool = False):
    from peft import LoraConfig

    return LoraConfig(
        r=adapter.rank,
        lora_alpha=adapter.alpha,
        lora_dropout=adapter.dropout,
        target_modules=list(adapter.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=inference_mode,
    )


def adapter_config_dict(adapter: AdapterSpec) -> dict[str, Any]:
    """The JSON-able adapter config an engine receives next to the tensors (docs/system.md §3.1,
    build_lora_sync_config)."""
    return {
        "peft_type": "LORA",
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": list(adapter.target_modules),
        "lora_dropout": adapter.dropout,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def load_lora_model(model_path: str, adapter: AdapterSpec, *, seed: int):
    """Load the base in fp32, freeze it, and add a freshly initialised adapter (A random from ``seed``, B zero)."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, lora_config(adapter), adapter_name=PEFT_ADAPTER)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    if not trainable or any(".lora_" not in n for n in trainable):
        raise ValueError(f"target_modules {adapter.target_modules} gave no LoRA-only trainable set: {trainable[:4]}")
    if adapter.init_path:
        load_starting_adapter(model, Path(adapter.init_path))
    return model


def load_starting_adapter(model, folder: Path) -> None:
    """Start from a saved PEFT adapter (adapters.path): every LoRA tensor of the model is replaced, or it fails."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(folder / "adapter_model.safetensors")
    try:
        result = set_peft_model_state_dict(model, state, adapter_name=PEFT_ADAPTER)
    except RuntimeError as error:  # torch's size mismatch: a different rank or projection shape
        raise ValueError(f"{folder} does not fit the planned adapter: {error}") from error
    expected = {name.replace(f".{PEFT_ADAPTER}.", ".") for name in trainable_state(model)}
    missing = sorted(expected - set(state))
    if result.unexpected_keys or missing:
        raise ValueError(
            f"{folder} does not fit the planned adapter: missing {missing[:3]}, "
            f"unexpected {list(result.unexpected_keys)[:3]}"
        )


def enable_recompute(model) -> None:
    """Activation recomputation (trainer.parallel.recompute): every decoder layer keeps only its input and runs
    its forward again in the backward pass. Non-reentrant checkpointing, so the LoRA weights inside a layer get
    gradients although the frozen base gives the layer inputs no grad."""
    model.get_base_model().activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks under a peft-wrapped HF causal LM (the FSDP2 sharding units)."""
    return list(model.get_base_model().model.layers)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().cpu().clone()


def trainable_state(model) -> dict[str, torch.Tensor]:
    """The adapter's parameters under the model's own names (checkpoints); collective under FSDP2."""
    return {name: _full(p) for name, p in model.named_parameters() if p.requires_grad}


def peft_adapter_state(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT naming (what ``save_pretrained`` writes); collective under FSDP2."""
    return {name: _full(t) for name, t in peft_adapter_views(model).items()}


def peft_adapter_views(model) -> dict[str, torch.Tensor]:
    """The adapter's tensors in PEFT naming, sharing the parameters' memory (no copy: they change with the next
    optimizer step); one rank's shards under FSDP2."""
    from peft import get_peft_model_state_dict

    return {name: t.detach() for name, t in get_peft_model_state_dict(model, adapter_name=PEFT_ADAPTER).items()}


def move_adapter(model, homes: dict[str, torch.Tensor]) -> None:
    """Make `homes` (by PEFT name, holding the current values) the memory of the adapter's parameters: the optimizer
    updates them there from now on. Nothing moves unless every adapter tensor is a parameter and has a home."""
    parameters = {p.data_ptr(): p for p in model.parameters() if p.requires_grad}
    views = peft_adapter_views(model)
    if views.keys() != homes.keys() or any(t.data_ptr() not in parameters for t in views.values()):
        raise ValueError("the adapter's tensors are not its parameters one to one; they cannot move")
    for name, view in views.items():
        parameter, home = parameters[view.data_ptr()], homes[name]
        if home.shape != parameter.shape or home.dtype != parameter.dtype or not torch.equal(home, parameter):
            raise ValueError(f"the new home of {name} does not hold its values")
    for name, view in views.items():
        parameters[view.data_ptr()].data = homes[name]
