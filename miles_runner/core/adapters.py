"""Adapter naming: the one place that says what an adapter is called on the engines and in request ids.

Spec §3.1 and §4.5: a single adapter is served as `miles_lora`; multi-LoRA adapters live in engine slots named
`__miles_slot_{k}`; a multi-LoRA request id is `name::uuid`, so an abort by the prefix `name::` can never reach
another adapter (valid names cannot contain `::`).
"""

from __future__ import annotations

import re
import uuid

LORA_ADAPTER_NAME = "miles_lora"
SLOT_PREFIX = "__miles_slot_"
RID_SEPARATOR = "::"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def slot_lora_name(slot: int) -> str:
    return f"{SLOT_PREFIX}{slot}"


def make_rid(adapter: str) -> str:
    return f"{adapter}{RID_SEPARATOR}{uuid.uuid4().hex}"


def rid_prefix(adapter: str) -> str:
    return f"{adapter}{RID_SEPARATOR}"


def parse_adapter(rid: str) -> str | None:
    adapter, sep, _ = rid.rpartition(RID_SEPARATOR)
    return adapter if sep else None


def extra_key(adapter: str, version: int) -> str:
    """Radix-cache namespace: a new adapter version never reuses KV computed under the old one."""
    return f"{adapter}:v{version}"


def adapter_request_fields(adapter: str, lora_path: str, version: int) -> dict[str, str]:
    """The fields every multi-LoRA request carries (spec §4.5): the engine slot it decodes with, a rid that a
    prefix abort of this adapter reaches, and the radix-cache namespace of this adapter version."""
    return {"lora_path": lora_path, "rid": make_rid(adapter), "extra_key": extra_key(adapter, version)}


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter (it becomes a folder name and a rid prefix), or None if it can."""
    if not name:
        return "an adapter needs a name"
    if name in (".", ".."):
        return f"'{name}' would name a parent or current folder"
    if not _SAFE_NAME.match(name):
        return f"'{name}' may use only letters, digits, '.', '_' and '-' (no path separators, no '::')"
    if name.startswith(SLOT_PREFIX) or name == LORA_ADAPTER_NAME:
        return f"'{name}' is reserved for engine-side adapter names"
    return None
