"""The one place for the R3 (routing replay) wire format, shared by engine, session server and rollout.

SGLang returns ``meta_info.routed_experts`` as standard base64 (with padding) of the raw bytes of a
C-contiguous int32 array shaped ``(rows, num_layers, top_k)``, little-endian, where
``rows = prompt_tokens + completion_tokens - 1 - routed_experts_start_len``: the last sampled token is never
forwarded, so it has no row. Dense layers read as 0. The payload is flat, so a reader must know
``num_layers`` and infers ``top_k`` from the size (docs/system.md §5).

Payloads go through pybase64 (SIMD): a long session of a large MoE carries tens of megabytes of routing,
which the stdlib codec decodes many times slower (bench/r3_merge_speed.py).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np
import pybase64

ROUTED_EXPERTS_DTYPE = np.dtype("<i4")


def encode_routed_experts(arr: np.ndarray) -> str:
    """Encode a ``(rows, layers, topk)`` int32 array as base64 of its raw little-endian bytes."""
    if arr.ndim != 3:
        raise ValueError(f"routed experts must be 3-D (rows, layers, topk), got shape {arr.shape}")
    if arr.dtype != np.int32:
        raise ValueError(f"routed experts must be int32, got {arr.dtype}")
    return pybase64.b64encode_as_string(np.ascontiguousarray(arr, dtype=ROUTED_EXPERTS_DTYPE).data)


def decode_routed_experts(b64: str, num_tokens: int, num_layers: int) -> np.ndarray:
    """Decode a payload into ``(num_tokens, num_layers, topk)`` int32, ``topk`` inferred from the size.

    ``num_tokens`` is the number of rows expected (usually ``len(tokens) - 1 - start``). An empty
    ``(0, num_layers, 0)`` comes back for ``num_tokens <= 0``. A payload with exactly one extra row (the
    stop-edge row some engine builds emit) has that row dropped. Any other size is a ``ValueError``. The array
    is a writable view of the decoded bytes (no copy).
    """
    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    if num_tokens <= 0:
        return np.zeros((0, num_layers, 0), dtype=np.int32)
    raw = _b64decode(b64)
    if len(raw) % ROUTED_EXPERTS_DTYPE.itemsize:
        raise ValueError(f"routed experts payload has {len(raw)} bytes, not a whole number of int32 values")
    flat = np.frombuffer(raw, dtype=ROUTED_EXPERTS_DTYPE).astype(np.int32, copy=False)  # a copy on big-endian only
    topk = flat.size // (num_tokens * num_layers)
    if topk > 0 and flat.size == (num_tokens + 1) * num_layers * topk:
        flat = flat[: num_tokens * num_layers * topk]
    if topk == 0 or flat.size != num_tokens * num_layers * topk:
        raise ValueError(
            f"routed experts payload has {flat.size} int32 values, which is not num_tokens ({num_tokens}) "
            f"x num_layers ({num_layers}) x topk for any topk >= 1 (nor one stop-edge row more)"
        )
    return flat.reshape(num_tokens, num_layers, topk)


def _b64decode(b64: str) -> bytearray:
    """Strict base64 at SIMD speed; a payload with characters outside the alphabet (line breaks) is decoded as
    the stdlib's lenient `b64decode` always did (those characters are skipped)."""
    try:
        return pybase64.b64decode_as_bytearray(b64, validate=True)
    except binascii.Error:
        return bytearray(base64.b64decode(b64))
