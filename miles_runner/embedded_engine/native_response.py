"""``/generate`` response objects (docs/sglang-protocol.md §1.3-1.5) built from a ``GenerationResult``."""

from __future__ import annotations

from typing import Any

from miles_runner.embedded_engine.request import GenerationResult

_LOGPROB_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "input_token_ids_logprobs",
    "output_token_ids_logprobs",
)


def meta_info(result: GenerationResult) -> dict:
    """SGLang's ``meta_info``; a request aborted while still queued gets the reduced form (no prompt_tokens)."""
    meta: dict = {"id": result.rid, "finish_reason": result.finish_reason}
    if not result.in_queue_abort:
        meta["prompt_tokens"] = result.prompt_tokens
        meta["cached_tokens"] = result.cached_tokens
        meta["num_retractions"] = result.num_retractions
    meta["weight_version"] = result.weight_version
    meta["completion_tokens"] = len(result.output_ids)
    meta["e2e_latency"] = result.e2e_latency
    for key in _LOGPROB_KEYS:
        value = getattr(result, key)
        if value is not None:
            meta[key] = value
    if result.routed_experts is not None:
        meta["routed_experts"] = result.routed_experts
    return meta


def generate_item(result: GenerationResult, index: int | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {
        "text": result.text,
        "output_ids": result.output_ids,
        "meta_info": meta_info(result),
    }
    if index is not None:
        item["index"] = index
    return item
