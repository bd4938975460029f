"""One turn's wire handling, pure: the chat request a turn makes (recorded as the turn's request, and sent as
SGLang's /generate: sglang_client/chat_as_generate.py), and what the agent gets back."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

from miles_runner.core.adapters import adapter_request_fields
from miles_runner.session.config import AdapterSlot, SessionServerConfig
from miles_runner.session.errors import MessageValidationError, UpstreamResponseError
from miles_runner.session.messages import Message, normalize_message
from miles_runner.sglang_client.chat_as_generate import model_adapter, unsupported_chat_fields

REPLAY_KEYS = ("routed_experts", "indexer_topk")
# The chat fields this server reads itself (the engine checks the ones it only passes on).
READ_FIELD_TYPES: dict[str, type] = {"model": str, "stream": bool, "stream_options": dict}
READ_FIELD_NAMES = {str: "a string", bool: "true or false", dict: "an object"}


def prepare_chat_request(
    body: dict[str, Any], config: SessionServerConfig, adapter: AdapterSlot | None
) -> tuple[dict[str, Any], bool]:
    """The upstream body (without input_ids yet) and whether the agent asked for a stream."""
    for name, kind in READ_FIELD_TYPES.items():
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise MessageValidationError(f"{name} must be {READ_FIELD_NAMES[kind]}, got {type(body[name]).__name__}")
    upstream = dict(body)
    stream = bool(upstream.pop("stream", False))
    upstream.pop("stream_options", None)
    if upstream.get("n", 1) != 1:
        raise MessageValidationError("a session turn generates one choice; n must be 1")
    if unsupported := unsupported_chat_fields(upstream):
        raise MessageValidationError(
            f"a session turn cannot honour the chat fields {', '.join(unsupported)} (it is generated with "
            "SGLang's /generate on the prompt's token ids); remove them"
        )
    template_kwargs = upstream.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise MessageValidationError("chat_template_kwargs must be an object")
    tools = upstream.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise MessageValidationError("tools must be a list")
    # Training needs the sampled tokens and their logprobs, and the stop token kept in the ids.
    upstream.update(logprobs=True, return_meta_info=True, no_stop_trim=False)
    if config.return_routed_experts:
        upstream["return_routed_experts"] = True
    upstream.update(_adapter_fields(config, adapter, upstream.get("model")))
    # The server owns the turn's rid (DELETE and shutdown abort the turn by it; an agent's own rid could
    # collide with another session's): an adapter slot's "{name}::uuid", else a fresh uuid.
    if adapter is None:
        upstream["rid"] = uuid.uuid4().hex
    return upstream, stream


def _adapter_fields(config: SessionServerConfig, adapter: AdapterSlot | None, model: str | None) -> dict[str, str]:
    """The adapter overrides whatever the agent sent: no turn may silently come from the base model."""
    if adapter is not None:
        fields = adapter_request_fields(adapter.name, adapter.lora_name, adapter.version)
    elif config.lora_name is not None:
        fields = {"lora_path": config.lora_name}
    else:
        return {}
    named = model_adapter(model)  # SGLang generates with the adapter `model` names, whatever lora_path says
    if named is not None and named != fields["lora_path"]:
        raise MessageValidationError(
            f"model {model!r} names the adapter {named!r}, but this session generates with "
            f"{fields['lora_path']!r}; send the model without ':{named}'"
        )
    return fields


def extract_completion(response: dict[str, Any]) -> tuple[list[int], Message]:
    """The generated token ids and the assistant message; 502 when the reply cannot make a record."""
    try:
        choice = response["choices"][0]
        triples = choice["meta_info"]["output_token_logprobs"]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as error:
        raise UpstreamResponseError(
            f"the engine reply has no choices[0].meta_info.output_token_logprobs or message ({error!r})"
        ) from error
    if message.get("content") is None:
        raise UpstreamResponseError("the engine reply has null message content")
    completion_tokens = (response.get("usage") or {}).get("completion_tokens")
    if completion_tokens != len(triples):
        raise UpstreamResponseError(
            f"the engine reply has {len(triples)} output logprobs but usage.completion_tokens={completion_tokens}"
        )
    return [int(t[1]) for t in triples], normalize_message({**message, "role": "assistant"})


def strip_replay_payloads(response: dict[str, Any]) -> dict[str, Any]:
    """A copy for the agent without routing/indexer payloads (the record keeps the original)."""
    reply = dict(response)
    reply["choices"] = [_strip_choice(choice) for choice in response.get("choices", [])]
    if isinstance(response.get("sglext"), dict):
        reply["sglext"] = {k: v for k, v in response["sglext"].items() if k not in REPLAY_KEYS}
    return reply


def _strip_choice(choice: dict[str, Any]) -> dict[str, Any]:
    meta = choice.get("meta_info")
    if not isinstance(meta, dict):
        return choice
    return {**choice, "meta_info": {k: v for k, v in meta.items() if k not in REPLAY_KEYS}}


def fake_stream(reply: dict[str, Any]) -> Iterator[str]:
    """The reply as one `chat.completion.chunk` SSE event, then [DONE] (the engine call never streams)."""
    chunk = {
        "id": reply.get("id"),
        "object": "chat.completion.chunk",
        "created": reply.get("created"),
        "model": reply.get("model"),
        "choices": [_delta_choice(choice) for choice in reply.get("choices", [])],
        "usage": reply.get("usage"),
    }
    yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


def _delta_choice(choice: dict[str, Any]) -> dict[str, Any]:
    message = choice.get("message") or {}
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [{**call, "index": i} for i, call in enumerate(message["tool_calls"])]
    return {
        "index": choice.get("index", 0),
        "delta": delta,
        "finish_reason": choice.get("finish_reason"),
        "logprobs": None,
    }
