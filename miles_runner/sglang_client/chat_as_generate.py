"""An OpenAI chat turn spoken as SGLang's native /generate, for a caller that owns the prompt's token ids.

`generate_body` is the `GenerateReqInput` that SGLang 0.5.23's serving_chat adapts a chat request to
(`ChatCompletionRequest.to_sampling_params`, then `GenerateReqInput(...)` in `_handle_request`), with the
prompt given as `input_ids`. `chat_completion` is the chat.completion `_build_chat_response` makes of the
native results. No reasoning or tool-call parser runs: the plan starts SGLang without --reasoning-parser and
--tool-call-parser, and then SGLang's message is the generated text too.

A chat field this translation cannot carry is refused by name (`unsupported_chat_fields`), never dropped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

# chat field -> SGLang sampling_params key, as in to_sampling_params.
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "regex": "regex",
    "ebnf": "ebnf",
    "n": "n",
    "no_stop_trim": "no_stop_trim",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "logit_bias": "logit_bias",
    "custom_params": "custom_params",
    "seed": "sampling_seed",
}
# Values chat takes from the model's generation_config.json when the request leaves them unset
# (SGLang's default --sampling-defaults model); /generate would use its own defaults instead.
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# Top-level GenerateReqInput fields a chat request carries under the same name.
REQUEST_FIELDS = ("lora_path", "rid", "extra_key", "return_routed_experts", "routed_experts_start_len")
# Fields that shape the prompt or the reply rather than the generation, and fields SGLang reads only with a
# parser the plan never starts.
REPLY_FIELDS = frozenset(
    {
        "model",
        "messages",
        "tools",
        "chat_template_kwargs",
        "input_ids",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "return_meta_info",
        "user",
        "parallel_tool_calls",
        "separate_reasoning",
        "stream_reasoning",
    }
)
_KNOWN_FIELDS = REPLY_FIELDS | set(SAMPLING_FIELDS) | set(REQUEST_FIELDS) | {"tool_choice", "stream"}


def unsupported_chat_fields(chat: Mapping[str, Any]) -> list[str]:
    """The chat fields a /generate turn cannot honour (unknown ones, a stream, a forced tool call)."""
    unsupported = sorted(set(chat) - _KNOWN_FIELDS)
    if chat.get("stream"):
        unsupported.append("stream")
    if chat.get("tool_choice") not in (None, "auto", "none"):
        unsupported.append("tool_choice")  # a forced call is constrained decoding by the tool-call parser
    return unsupported


def generate_body(chat: Mapping[str, Any], *, model_defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The /generate body for a chat request whose `input_ids` hold the rendered prompt.

    ValueError names the fields that cannot be carried. `model_defaults` are the model's generation_config
    sampling values (see MODEL_DEFAULT_FIELDS)."""
    if unsupported := unsupported_chat_fields(chat):
        raise ValueError(f"chat fields that cannot be sent as /generate: {', '.join(unsupported)}")
    if not chat.get("input_ids"):
        raise ValueError("a /generate turn needs the prompt as input_ids")
    body: dict[str, Any] = {
        "input_ids": list(chat["input_ids"]),
        "sampling_params": sampling_params(chat, model_defaults or {}),
        "return_logprob": bool(chat.get("logprobs")),
        "logprob_start_len": -1,
        "top_logprobs_num": chat.get("top_logprobs") or 0,
        "return_text_in_logprobs": True,
        "stream": False,
    }
    body.update({key: chat[key] for key in REQUEST_FIELDS if chat.get(key) is not None})
    if adapter := model_adapter(chat.get("model")):
        body["lora_path"] = adapter  # SGLang: the adapter in `model` wins over lora_path
    return body


def sampling_params(chat: Mapping[str, Any], model_defaults: Mapping[str, Any]) -> dict[str, Any]:
    """to_sampling_params: the request's value, else the model's default, else SGLang's (left out)."""
    params: dict[str, Any] = {
        # Always sent: chat without a limit generates up to the context, /generate without one 128 tokens.
        "max_new_tokens": chat.get("max_completion_tokens") or chat.get("max_tokens"),
    }
    for field, key in SAMPLING_FIELDS.items():
        value = chat.get(field)
        if value is None and field in MODEL_DEFAULT_FIELDS:
            value = model_defaults.get(field)
        if value is not None:
            params[key] = value
    spaces = (chat.get("chat_template_kwargs") or {}).get("spaces_between_special_tokens")
    if spaces is not None:
        params["spaces_between_special_tokens"] = spaces
    return params


def model_adapter(model: str | None) -> str | None:
    """The adapter of `model: "base:adapter"` (SGLang's _parse_model_parameter), else None."""
    _, colon, adapter = (model or "").partition(":")
    return adapter if colon and adapter else None


# ---- the reply ----------------------------------------------------------------------------------------------
def chat_completion(
    items: Sequence[Mapping[str, Any]],
    *,
    model: str,
    logprobs: bool,
    return_meta_info: bool,
    response_id: str | None = None,
) -> dict[str, Any]:
    """The chat.completion of native /generate results (one per choice), as _build_chat_response makes it."""
    metas = [item["meta_info"] for item in items]
    prompt = metas[0].get("prompt_tokens", 0)
    completion = sum(meta.get("completion_tokens", 0) for meta in metas)
    response: dict[str, Any] = {
        "id": response_id or metas[0]["id"],
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [_choice(i, item, logprobs, return_meta_info) for i, item in enumerate(items)],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "reasoning_tokens": sum(meta.get("reasoning_tokens", 0) for meta in metas),
        },
        "metadata": {"weight_version": metas[0].get("weight_version")},
    }
    routed = metas[0].get("routed_experts")
    if routed is not None and not return_meta_info:  # with meta_info it travels only there (SGLang #35323)
        response["sglext"] = {"routed_experts": routed}
    return response


def _choice(index: int, item: Mapping[str, Any], logprobs: bool, return_meta_info: bool) -> dict[str, Any]:
    meta = item["meta_info"]
    finish = meta.get("finish_reason") or {}
    choice: dict[str, Any] = {
        "index": index,
        "message": {
            "role": "assistant",
            "content": item.get("text") or "",
            "reasoning_content": None,
            "tool_calls": None,
        },
        "logprobs": openai_logprobs(meta.get("output_token_logprobs"), meta.get("output_top_logprobs"))
        if logprobs
        else None,
        "finish_reason": finish.get("type"),
        "matched_stop": finish.get("matched"),
    }
    if return_meta_info:
        choice["meta_info"] = dict(meta)
    return choice


def openai_logprobs(triples: Sequence[Sequence[Any]] | None, tops: Sequence[Sequence[Any]] | None) -> dict:
    """OpenAI `logprobs.content` from SGLang's `[logprob, token_id, text]` triples and top-k lists."""
    content = []
    for position, (logprob, _token_id, text) in enumerate(triples or []):
        entry = _token_entry(text, logprob)
        entry["top_logprobs"] = [_token_entry(t, lp) for lp, _i, t in tops[position]] if tops else []
        content.append(entry)
    return {"content": content}


def _token_entry(text: str | None, logprob: float | None) -> dict[str, Any]:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
