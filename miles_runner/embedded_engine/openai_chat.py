"""``/v1/chat/completions`` on top of the native engine (SGLang's serving_chat; docs/sglang-protocol.md §8).

Mapping: ``logprobs`` -> ``return_logprob`` (with token text), ``top_logprobs`` -> ``top_logprobs_num``,
``max_completion_tokens or max_tokens`` -> ``max_new_tokens``, ``seed`` -> ``sampling_seed``; the adapter is
the suffix of ``model: "base:adapter"`` or else ``lora_path``. ``input_ids`` bypasses the chat template.
Routed experts go to the top-level ``sglext`` (first choice), or, with ``return_meta_info``, only into each
``choices[i].meta_info`` (de-duplicated as in SGLang PR #35323).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from miles_runner.embedded_engine.engine import EmbeddedEngine
from miles_runner.embedded_engine.native_response import generate_item
from miles_runner.embedded_engine.protocol import ChatCompletionRequest, SamplingParams
from miles_runner.embedded_engine.request import GenerationResult, GenRequest, LogprobRequest
from miles_runner.sglang_client.chat_as_generate import chat_completion, model_adapter, openai_logprobs

_STREAM_INCOMPATIBLE = {
    "return_meta_info": "return_meta_info is not supported with streaming.",
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming.",
    "return_token_ids": (
        "return_token_ids is not supported with streaming on /v1/chat/completions. "
        "Please set stream=false when using return_token_ids=true."
    ),
}


def openai_error(message: str, code: int = 400, err_type: str = "BadRequestError") -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def build_chat_requests(engine: EmbeddedEngine, body: ChatCompletionRequest) -> tuple[str, list[GenRequest]]:
    if body.stream:
        for flag, message in _STREAM_INCOMPATIBLE.items():
            if getattr(body, flag):
                raise ValueError(message)
    if body.top_logprobs is not None and body.top_logprobs < 0:  # named as the chat client spells it
        raise ValueError(f"top_logprobs must be at least 0, got {body.top_logprobs}.")
    adapter = _adapter(body)
    engine.lora.resolve([adapter])
    rid = body.rid or uuid.uuid4().hex
    params = SamplingParams(
        max_new_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        min_new_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        no_stop_trim=body.no_stop_trim,
        skip_special_tokens=body.skip_special_tokens,
        n=body.n,
        sampling_seed=body.seed,
    )
    logprob = LogprobRequest(return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0, return_text=True)
    requests = engine.samples_for_prompt(
        rid,
        chat_prompt_ids(engine, body),
        params,
        adapter=adapter,
        logprob=logprob,
        routed=body.return_routed_experts,
        routed_start=body.routed_experts_start_len,
        stream=body.stream,
        extra_key=body.extra_key or None,
    )
    return rid, requests


def _adapter(body: ChatCompletionRequest) -> str | None:
    return model_adapter(body.model) or body.lora_path


def chat_prompt_ids(engine: EmbeddedEngine, body: ChatCompletionRequest) -> list[int]:
    if body.input_ids is not None:
        return list(body.input_ids)
    messages = [{"role": m.role, "content": _content_text(m.content)} for m in body.messages]
    try:
        return list(
            engine.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                tokenize=True,
                return_dict=False,
                **(body.chat_template_kwargs or {}),
            )
        )
    except Exception as exc:  # jinja and template-argument errors are the caller's input
        raise ValueError(f"Failed to apply the chat template: {exc}") from exc


def _content_text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type", "text") == "text")


# ----- responses ---------------------------------------------------------------------------------------------
def chat_response(
    body: ChatCompletionRequest, rid: str, requests: list[GenRequest], results: list[GenerationResult]
) -> dict:
    items = [generate_item(result) for result in results]
    response = chat_completion(
        items, model=body.model, logprobs=body.logprobs, return_meta_info=body.return_meta_info, response_id=rid
    )
    for choice, request, result in zip(response["choices"], requests, results, strict=True):
        if body.return_prompt_token_ids:
            choice["prompt_token_ids"] = request.input_ids
        if body.return_token_ids:
            choice["token_ids"] = result.output_ids
    return response


def _sglext(body: ChatCompletionRequest, first: GenerationResult) -> dict:
    if first.routed_experts is not None and not body.return_meta_info:
        return {"routed_experts": first.routed_experts}
    return {}


def _logprobs(result: GenerationResult, start: int) -> dict:
    """OpenAI ``logprobs.content`` for output tokens from ``start`` on."""
    return openai_logprobs((result.output_token_logprobs or [])[start:], (result.output_top_logprobs or [])[start:])


# ----- streaming ---------------------------------------------------------------------------------------------
async def chat_stream(
    engine: EmbeddedEngine, body: ChatCompletionRequest, rid: str, requests: list[GenRequest]
) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        payload = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
        return _sse({**payload, "choices": choices, **extra})

    sent_text = [""] * len(requests)
    sent_tokens = [0] * len(requests)
    finals: dict[int, GenerationResult] = {}
    for index in range(len(requests)):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    async for index, result in engine.generate(requests, parent_rid=rid):
        finished = result.finish_reason is not None
        text = result.text if finished else result.text.rstrip("\ufffd")  # hold back half a character
        delta = text[len(sent_text[index]) :] if text.startswith(sent_text[index]) else ""
        choice: dict[str, Any] = {"index": index, "delta": {"content": delta}, "finish_reason": None}
        if body.logprobs:
            choice["logprobs"] = _logprobs(result, sent_tokens[index])
        if result.finish_reason is not None:
            finals[index] = result
            choice["finish_reason"] = result.finish_reason["type"]
            choice["matched_stop"] = result.finish_reason.get("matched")
        sent_text[index] += delta
        sent_tokens[index] = len(result.output_ids)
        if delta or finished or (body.logprobs and choice["logprobs"]["content"]):
            yield chunk([choice])
    results = [finals[i] for i in range(len(requests))]
    sglext = _sglext(body, results[0])
    if sglext:
        yield chunk([], sglext=sglext)
    if body.stream_options is not None and body.stream_options.include_usage:
        completion = sum(len(r.output_ids) for r in results)
        usage = {
            "prompt_tokens": results[0].prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": results[0].prompt_tokens + completion,
        }
        yield chunk([], usage=usage)
    yield "data: [DONE]\n\n"


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
