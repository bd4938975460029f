"""JSON request bodies that carry megabytes of base64 (tensors for `/load_lora_adapter_from_tensors`).

`json.dumps` scans every character of a string for escapes; on an adapter's megabytes that is the largest cost of a
tensor sync on the trainer's side (bench/adapter_sync_bandwidth.py). Base64 text needs no JSON escaping, so
its strings are spliced into the body as they are. The result parses to exactly the body given; a string that
is not plain base64 falls back to `json.dumps` for the whole body, so nothing else is ever sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

BASE64_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)  # as httpx's json=


def dumps_with_base64(body: Mapping[str, Any], field: str) -> bytes:
    """`body` as JSON bytes, where `body[field]` is a list of base64 strings."""
    encoded = _as_base64_bytes(body[field])
    if encoded is None:
        return _dumps(body).encode()
    rest = _dumps({key: value for key, value in body.items() if key != field})
    head = f"{rest[:-1]}{',' if len(rest) > 2 else ''}{_dumps(field)}:[".encode()
    parts = [head]
    for index, text in enumerate(encoded):
        parts += [b',"' if index else b'"', text, b'"']
    parts.append(b"]}")
    return b"".join(parts)


def _as_base64_bytes(values: Any) -> list[bytes] | None:
    """ASCII bytes of every string when all are base64 text (so JSON needs no escape in them), else None."""
    if not isinstance(values, list) or not all(isinstance(v, str) and v.isascii() for v in values):
        return None
    encoded = [value.encode("ascii") for value in values]
    return None if any(text.translate(None, BASE64_ALPHABET) for text in encoded) else encoded
