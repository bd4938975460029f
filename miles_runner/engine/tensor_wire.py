"""How tensors travel in a JSON body to the embedded engine (LoRA and base weights from the trainer).

Real SGLang takes ``MultiprocessingSerializer`` pickles (CUDA IPC handles; same node only). The embedded
engine is CPU-only and must not unpickle request bodies, so it takes a **base64 string of a safetensors
blob** instead: name -> tensor, any dtype safetensors supports, shapes preserved. The same string is used for

- ``/load_lora_adapter_from_tensors``: ``serialized_tensors`` = ``serialize_lora_tensors(peft_state_dict)``
  (keys as ``peft.get_peft_model_state_dict`` gives them, e.g. ``base_model.model.model.layers.0.
  self_attn.q_proj.lora_A.weight``), next to ``config_dict`` (the adapter's ``LoraConfig`` as a dict);
- ``/update_weights_from_tensor``: ``serialized_named_tensors`` = ``[serialize_named_tensors(...)]`` (one
  entry per TP rank; the embedded engine has one), keys as the HF model's parameter names.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping

import torch
from safetensors.torch import load, save

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """Pack ``{name: tensor}`` (or ``(name, tensor)`` pairs) into a base64 safetensors string."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    plain = {name: tensor.detach().cpu().contiguous().clone() for name, tensor in items}
    return base64.b64encode(save(plain)).decode("ascii")


def deserialize_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_named_tensors`; raises ``ValueError`` on a malformed payload."""
    try:
        return load(base64.b64decode(payload, validate=True))
    except Exception as exc:  # binascii.Error, safetensors errors: all mean a bad request body
        raise ValueError(f"serialized tensors are not a base64 safetensors blob: {exc}") from exc


def serialize_lora_tensors(named_tensors: NamedTensors) -> str:
    """The ``serialized_tensors`` field of ``/load_lora_adapter_from_tensors`` for the embedded engine."""
    return serialize_named_tensors(named_tensors)
