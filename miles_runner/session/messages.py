"""OpenAI chat messages in one canonical form, and the strict matcher that compares them.

Agents echo the assistant's reply back in many spellings (content None or "", SDK models dumped with
`refusal: None`, text parts instead of a string); the canonical form makes those compare equal, and is
also what the chat template renders.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from miles_runner.session.errors import MessageValidationError

Message = dict[str, Any]

_KEPT_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


def normalize_message(message: Any) -> Message:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise MessageValidationError(f"each message must be an object with a string role, got {message!r}")
    normalized: Message = {"role": message["role"], "content": _content_text(message.get("content"))}
    for key in _KEPT_KEYS[2:]:
        value = message.get(key)
        if value not in (None, [], ""):
            normalized[key] = _normalize_tool_calls(value) if key == "tool_calls" else value
    return normalized


def normalize_messages(messages: Any) -> list[Message]:
    if not isinstance(messages, list) or not messages:
        raise MessageValidationError("`messages` must be a non-empty list")
    return [normalize_message(m) for m in messages]


def matching_prefix_len(stored: Sequence[Message], request: Sequence[Message]) -> int:
    """Number of leading request messages equal to the stored ones (the `strict` matcher)."""
    count = 0
    for old, new in zip(stored, request, strict=False):
        if old != new:
            break
        count += 1
    return count


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of_part(part) for part in content)
    raise MessageValidationError(f"message content must be a string or a list of parts, got {content!r}")


def _text_of_part(part: Any) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise MessageValidationError(f"only text content parts are supported, got {part!r}")


def _normalize_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise MessageValidationError(f"tool_calls must be a list, got {tool_calls!r}")
    return [_normalize_tool_call(call) for call in tool_calls]


def _normalize_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise MessageValidationError(f"a tool call needs function.name, got {call!r}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        # Templates render arguments as objects; the wire carries them as JSON text.
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    normalized = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id"):
        normalized["id"] = call["id"]
    return normalized
