"""The /samples wire format (docs/system.md §2.9): one safetensors blob, tensors keyed "{field}.{i}", and a uint8
tensor `_samples_meta` holding the JSON fields, the session metadata and the empty reason.

Both directions are strict: a lossy cast, a routing tensor that is not int32, a dtype mismatch or a tensor
no sample refers to is an error, never a silent conversion.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load, save

from miles_runner.session.samples import Sample, SampleStatus

META_KEY = "_samples_meta"
EMPTY_REASONS = (None, "no_records", "all_truncated")
# Tensor fields and their wire dtypes; routing replay must already be int32 (it is never cast).
TENSOR_DTYPES: dict[str, np.dtype[Any]] = {
    "tokens": np.dtype(np.int64),
    "loss_mask": np.dtype(np.uint8),
    "rollout_log_probs": np.dtype(np.float64),
    "rollout_routed_experts": np.dtype(np.int32),
}
STRICT_FIELDS = frozenset({"rollout_routed_experts"})
JSON_FIELDS = ("response", "response_length", "status", "weight_versions", "prefix_cache_info", "metadata")


@dataclass(frozen=True)
class SamplesReply:
    samples: list[Sample]
    session_metadata: dict[str, Any]
    empty_reason: str | None


def encode_samples(
    samples: list[Sample],
    session_metadata: dict[str, Any],
    empty_reason: str | None = None,
    *,
    with_reward: bool = False,
) -> bytes:
    if empty_reason not in EMPTY_REASONS:
        raise ValueError(f"empty_reason must be one of {EMPTY_REASONS}, got {empty_reason!r}")
    tensors: dict[str, np.ndarray] = {}
    wire_samples = []
    for index, sample in enumerate(samples):
        fields = _json_fields(sample, with_reward)
        fields["nulls"] = []
        for name in TENSOR_DTYPES:
            value = getattr(sample, name)
            if value is None:
                fields["nulls"].append(name)
            else:
                tensors[f"{name}.{index}"] = _to_wire_tensor(name, value)
        wire_samples.append(fields)
    meta = {"samples": wire_samples, "session_metadata": session_metadata, "empty_reason": empty_reason}
    tensors[META_KEY] = np.frombuffer(json.dumps(meta, separators=(",", ":")).encode(), dtype=np.uint8)
    return save(tensors)


def decode_samples(blob: bytes) -> SamplesReply:
    try:
        tensors = dict(load(blob))
    except Exception as error:  # safetensors raises its own error types for malformed headers
        raise ValueError(f"samples payload is not a safetensors blob: {error}") from error
    if META_KEY not in tensors:
        raise ValueError(f"samples payload has no {META_KEY} tensor")
    try:
        meta = json.loads(tensors.pop(META_KEY).tobytes().decode())
        samples = [_decode_sample(index, fields, tensors) for index, fields in enumerate(meta["samples"])]
        reply = SamplesReply(samples, meta["session_metadata"], meta["empty_reason"])
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
        raise ValueError(f"samples payload metadata is malformed: {error!r}") from error
    if tensors:
        raise ValueError(f"samples payload has tensors no sample refers to: {sorted(tensors)}")
    return reply


def _json_fields(sample: Sample, with_reward: bool) -> dict[str, Any]:
    fields = {name: getattr(sample, name) for name in JSON_FIELDS}
    fields["status"] = sample.status.value
    if with_reward:
        fields["reward"] = sample.reward
    return fields


def _to_wire_tensor(name: str, value: Any) -> np.ndarray:
    dtype = TENSOR_DTYPES[name]
    if name in STRICT_FIELDS:
        if not isinstance(value, np.ndarray) or value.dtype != dtype:
            found = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"{name} must be an int32 ndarray, got {found}")
        return np.ascontiguousarray(value)
    source = np.asarray(value)
    if source.size and source.dtype.kind not in "biuf":
        raise ValueError(f"{name} must be numeric, got dtype {source.dtype}")
    wire = source.astype(dtype)
    if not np.array_equal(wire, source):
        raise ValueError(f"{name} cannot be written as {dtype} without changing its values")
    return np.ascontiguousarray(wire)


def _decode_sample(index: int, fields: dict[str, Any], tensors: dict[str, np.ndarray]) -> Sample:
    nulls = set(fields.pop("nulls"))
    values: dict[str, Any] = {}
    for name, dtype in TENSOR_DTYPES.items():
        key = f"{name}.{index}"
        if name in nulls:
            if key in tensors:
                raise ValueError(f"sample {index}: {name} is listed as null but tensor {key} is present")
            values[name] = None
            continue
        if key not in tensors:
            raise ValueError(f"sample {index}: tensor {key} is missing")
        tensor = tensors.pop(key)
        if tensor.dtype != dtype:
            raise ValueError(f"sample {index}: {key} has dtype {tensor.dtype}, expected {dtype}")
        values[name] = tensor if name in STRICT_FIELDS else tensor.tolist()
    fields["status"] = SampleStatus(fields["status"])
    return Sample(**values, **fields)
