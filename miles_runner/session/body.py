"""Request bodies the session server parses by hand: one JSON object, every number in it finite.

Python's json accepts NaN, Infinity and -Infinity (and reads 1e999 as inf), which are not JSON: a non-finite
number would reach the engine's sampling checks or fail later when the record is serialised, so it is refused
here with a 400 naming the field (`temperature`, `messages[0].content`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from miles_runner.session.errors import MessageValidationError


def parse_json_object(raw: bytes, *, allow_empty: bool = False) -> dict[str, Any]:
    """The body as a dict; MessageValidationError (400) for anything else."""
    if allow_empty and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise MessageValidationError(f"invalid JSON body: {error}") from error
    if not isinstance(body, dict):
        raise MessageValidationError("the JSON body must be an object")
    if (field := non_finite_field(body)) is not None:
        raise MessageValidationError(f"{field} must be a finite number (NaN and Infinity are not JSON)")
    return body


def non_finite_field(value: Any) -> str | None:
    """The path of the first non-finite float in a parsed JSON value, or None (iterative: bodies nest deep)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            return where or "the body"
        if isinstance(item, dict):
            stack += [(f"{where}.{key}" if where else str(key), child) for key, child in reversed(item.items())]
        elif isinstance(item, list):
            stack += [(f"{where}[{index}]", child) for index, child in reversed(list(enumerate(item)))]
    return None
