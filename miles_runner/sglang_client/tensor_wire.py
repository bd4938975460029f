"""How tensors travel in a JSON body to an engine (LoRA and base weights from the trainer).

SGLang 0.5.23's shape, which both engines take: `serialized_named_tensors` is a list with one entry per TP rank
(rank r reads entry r only), and each entry is a base64 string (io_struct: `Annotated[List[bytes],
Base64Bytes()]`; the HTTP body is JSON, so bytes travel as base64). The entries are the same on every route:

- `/load_lora_adapter_from_tensors`: the adapter, `{name: tensor}` with keys as
  `peft.get_peft_model_state_dict` gives them (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
  next to `config_dict` (its `LoraConfig` as a dict);
- `/update_weights_from_tensor`: base weights, keys as the HF model's parameter names.

The one difference, by engine kind, is what the base64 text decodes to:

- sglang: `MultiprocessingSerializer` bytes (a ForkingPickler pickle of CUDA IPC handles) of a dict
  name -> tensor for LoRA, of a list of (name, tensor) pairs for base weights;
- embedded: a safetensors blob of name -> tensor, for both.

SGLang's bytes are a pickle of CUDA IPC handles: valid only on the same node and GPU, and unpickled by the
server. The embedded engine runs on CPU and never unpickles a request body, so it takes safetensors instead:
same field, same list per rank, same base64 text, a different (data-only) payload inside. SGLang's serializer
makes a fresh copy per rank, as SGLang's own Engine does, so each rank can release its copy independently; the
embedded entries are immutable text, so one serialized string serves every rank. An embedded engine on the
trainer's host takes a third kind of entry, a handle to a shared-memory segment (tensor_shm.py, the CPU analogue
of the CUDA IPC handles).

Speed (bench/adapter_sync_bandwidth.py): base64 goes through pybase64 (SIMD; the stdlib codec is many times
slower), and tensors are not cloned first: safetensors' `save` already copies them into a blob of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import pybase64
import torch
from safetensors.torch import load, save

from miles_runner.sglang_client.tensor_shm import SegmentReader, handle_segment_name, is_handle, read_segment

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def serialize_named_tensors(named_tensors: NamedTensors) -> str:
    """Pack ``{name: tensor}`` (or ``(name, tensor)`` pairs) into a base64 safetensors string: one entry of
    ``serialized_named_tensors`` for the embedded engine."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    return pybase64.b64encode_as_string(save(_savable(items)))


def _savable(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors for safetensors' `save`, which copies them into its blob, so they are not cloned
    first; except a tensor that shares storage with an earlier one (tied weights), which `save` would refuse."""
    plain: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in items:
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        plain[name] = tensor.clone() if storage in storages else tensor
        storages.add(storage)
    return plain


def deserialize_named_tensors(payload: str) -> dict[str, torch.Tensor]:
    """Inverse of :func:`serialize_named_tensors`, or the tensors of the shared-memory segment a handle names
    (tensor_shm.py); tensors of their own either way. Raises ``ValueError`` on a malformed payload."""
    blob = _decoded(payload)
    return read_segment(handle_segment_name(blob)) if is_handle(blob) else _loaded(blob)


@contextlib.contextmanager
def borrowed_named_tensors(payload: str, segments: SegmentReader) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
    """(tensors, borrowed) of one entry, valid inside the block: a handle's tensors are views of the segment as
    `segments` maps it (borrowed: copy what you keep), an inline entry's are tensors of their own."""
    blob = _decoded(payload)
    if not is_handle(blob):
        yield _loaded(blob), False
        return
    with segments.borrow(handle_segment_name(blob)) as tensors:
        yield tensors, True


def _decoded(payload: str) -> bytes:
    try:
        return pybase64.b64decode(payload, validate=True)
    except Exception as exc:  # binascii.Error
        raise ValueError(f"serialized tensors are not a base64 safetensors blob (not base64: {exc})") from exc


def _loaded(blob: bytes) -> dict[str, torch.Tensor]:
    try:
        return load(blob)
    except Exception as exc:  # safetensors errors: all mean a bad request body
        raise ValueError(f"serialized tensors are not a base64 safetensors blob: {exc}") from exc


def serialize_lora_tensors(named_tensors: NamedTensors) -> str:
    """One entry of ``/load_lora_adapter_from_tensors``'s ``serialized_named_tensors`` for the embedded engine."""
    return serialize_named_tensors(named_tensors)


def lora_tensor_payloads(engine_kind: str, named_tensors: Mapping[str, Any], tp_size: int) -> list[str]:
    """``serialized_named_tensors`` of ``/load_lora_adapter_from_tensors`` for an engine of `engine_kind` with
    `tp_size` ranks: one copy per rank (see the table above for what each entry holds)."""
    if engine_kind == "embedded":
        return [serialize_lora_tensors(named_tensors)] * tp_size
    from sglang.srt.utils import MultiprocessingSerializer  # the gpu extra only

    return [MultiprocessingSerializer.serialize(dict(named_tensors), output_str=True) for _ in range(tp_size)]


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The sha256 `expected_checksums` carries for a tensor: of its raw bytes, as SGLang computes it."""
    raw = tensor.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def check_tensor_checksums(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, str]) -> None:
    """SGLang's `expected_checksums` check on received tensors: a ValueError names what differs, is missing or
    was not expected."""
    missing = [name for name in expected if name not in tensors]
    differ = [name for name in expected if name in tensors and tensor_checksum(tensors[name]) != expected[name]]
    extra = [name for name in tensors if name not in expected]
    if missing or differ or extra:
        raise ValueError(
            f"adapter sync mismatch of {len(expected)} expected tensors: {len(differ)} differ {differ[:5]}, "
            f"{len(missing)} missing {missing[:5]}, {len(extra)} unexpected {extra[:5]}"
        )
