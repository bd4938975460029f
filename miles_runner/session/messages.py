"""OpenAI chat messages in one canonical form, and the matchers (`session.message_matcher`) that decide whether
a replayed message is the stored one.

Agents echo the assistant's reply back in many spellings (content None or "", SDK models dumped with
`refusal: None`, text parts instead of a string); the canonical form makes those compare equal. It keeps a tool
call's `arguments` as sent (JSON text, as on the wire): whether a reserialised argument string is the same call
is the matcher's decision. `template_view` is what the chat template renders (arguments as objects, as SGLang
passes them).

Matchers (miles' message_matcher_hub), each comparing one stored message with its replay:
- `strict`: the fields a chat template reads (role, content, reasoning_content, tool_calls) are equal.
- `loose_tool_call`: strict, or equal but for tool-call arguments that are the same JSON object spelled
  differently (key order, spacing, 1 vs 1.0); ids, names, types, order and every other field still compare.
- `role_content_only`: role and content only; everything else (whole tool calls, reasoning) is ignored.
On a match the stored message is kept, not the replay: the stored spelling is what the tokens were made from.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from miles_runner.session.errors import MessageValidationError

Message = dict[str, Any]
Matcher = Callable[[Message, Message], bool]

_KEPT_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls")


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


def strict_matches(stored: Message, replayed: Message) -> bool:
    return all(stored.get(key) == replayed.get(key) for key in _TEMPLATE_KEYS)


def loose_tool_call_matches(stored: Message, replayed: Message) -> bool:
    if strict_matches(stored, replayed):
        return True
    if any(stored.get(key) != replayed.get(key) for key in ("role", "content", "reasoning_content")):
        return False
    calls, replayed_calls = stored.get("tool_calls") or [], replayed.get("tool_calls") or []
    return len(calls) == len(replayed_calls) and all(map(_same_call, calls, replayed_calls))


def role_content_only_matches(stored: Message, replayed: Message) -> bool:
    return stored["role"] == replayed["role"] and stored["content"] == replayed["content"]


MATCHERS: dict[str, Matcher] = {
    "strict": strict_matches,
    "loose_tool_call": loose_tool_call_matches,
    "role_content_only": role_content_only_matches,
}


def resolve_matcher(name: str) -> Matcher:
    if name not in MATCHERS:
        raise ValueError(f"message matcher must be one of {sorted(MATCHERS)}, got {name!r}")
    return MATCHERS[name]


def matching_prefix_len(
    stored: Sequence[Message], request: Sequence[Message], matcher: Matcher = strict_matches
) -> int:
    """Number of leading request messages that match the stored ones."""
    count = 0
    for old, new in zip(stored, request, strict=False):
        if not matcher(old, new):
            break
        count += 1
    return count


def template_view(messages: Sequence[Message]) -> list[Message]:
    """The messages as the chat template receives them: tool-call arguments that are JSON text as objects."""
    return [_with_object_arguments(m) if m.get("tool_calls") else m for m in messages]


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
    """The call without wire-only keys (a stream's `index`); `arguments` keeps its spelling."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise MessageValidationError(f"a tool call needs function.name, got {call!r}")
    normalized = {"type": "function", "function": {"name": function["name"], "arguments": function.get("arguments")}}
    if call.get("id"):
        normalized["id"] = call["id"]
    return normalized


def _with_object_arguments(message: Message) -> Message:
    calls = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template gets the text as it is
                arguments = json.loads(arguments)
        calls.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "tool_calls": calls}


def _same_call(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    if {k: v for k, v in stored.items() if k != "function"} != {k: v for k, v in replayed.items() if k != "function"}:
        return False
    left, right = stored["function"], replayed["function"]
    if left["name"] != right["name"]:
        return False
    left_args, right_args = _json_object(left["arguments"]), _json_object(right["arguments"])
    if left_args is None or right_args is None:  # not a JSON object: only the same spelling matches
        return left["arguments"] == right["arguments"] and type(left["arguments"]) is type(right["arguments"])
    return left_args == right_args


def _json_object(arguments: Any) -> tuple | None:
    """A JSON object's type-tagged form (keys sorted; 1 and 1.0 equal, True and 1 not), or None if `arguments`
    is not one. No arguments ("" or None) is the empty object; duplicate keys, NaN and Infinity are not JSON."""
    if arguments is None or arguments == "":
        return ("object", ())
    try:
        parsed = (
            json.loads(
                arguments,
                object_pairs_hook=_unique_keys,
                parse_float=Decimal,
                parse_int=Decimal,
                parse_constant=_no_constant,
            )
            if isinstance(arguments, str)
            else arguments
        )
        return _tagged(parsed) if isinstance(parsed, dict) else None
    except (ValueError, TypeError, RecursionError):
        return None


def _tagged(value: Any) -> tuple:
    if value is None:
        return ("null",)
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, int | float | Decimal):
        number = Decimal(str(value)) if isinstance(value, float) else Decimal(value)
        if not number.is_finite():
            raise ValueError("not a finite JSON number")
        return ("number", number)
    if isinstance(value, list):
        return ("array", tuple(_tagged(item) for item in value))
    if isinstance(value, dict):
        if not all(isinstance(key, str) for key in value):
            raise ValueError("JSON object keys are strings")
        return ("object", tuple(sorted((key, _tagged(item)) for key, item in value.items())))
    raise ValueError(f"{type(value).__name__} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len({key for key, _ in pairs}) != len(pairs):
        raise ValueError("duplicate JSON object key")
    return dict(pairs)


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not JSON")
