"""Reading SGLang results: pure helpers over a `/generate` result or a chat choice (both carry `meta_info`).

Tokens and logprobs come from `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples, aligned
with `output_ids`), as RL clients of real SGLang do. A chat choice has `meta_info` only when the request set
`return_meta_info: true`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from miles_runner.sglang_client.routed_experts import decode_routed_experts

Result = Mapping[str, Any]


def meta_info(result: Result) -> Mapping[str, Any]:
    try:
        return result["meta_info"]
    except KeyError:
        raise ValueError("no meta_info in the result (chat requests need return_meta_info: true)") from None


def output_token_logprobs(result: Result) -> tuple[list[int], list[float]]:
    """The generated token ids and their sampled logprobs (needs `return_logprob` / chat `logprobs`)."""
    triples = meta_info(result).get("output_token_logprobs")
    if triples is None:
        raise ValueError("no output_token_logprobs in meta_info: request them with return_logprob: true")
    return [int(t[1]) for t in triples], [float(t[0]) for t in triples]


def finish_reason_type(result: Result) -> str | None:
    """ "stop", "length" or "abort"; None while a stream is still running."""
    reason = meta_info(result).get("finish_reason")
    return reason["type"] if reason else None


def is_aborted(result: Result) -> bool:
    """An aborted request is a partial sample to retry or continue, not an error."""
    return finish_reason_type(result) == "abort"


def weight_version(result: Result) -> str | None:
    return meta_info(result).get("weight_version")


def prompt_tokens(result: Result, prompt_ids: Sequence[int]) -> int:
    """`meta_info.prompt_tokens`; results aborted while still queued may lack it, then it is the prompt's."""
    return int(meta_info(result).get("prompt_tokens", len(prompt_ids)))


def routed_experts(result: Result, *, num_layers: int, start_len: int = 0) -> np.ndarray | None:
    """Routed expert ids, int32 `(prompt + completion - 1 - start_len, num_layers, top_k)`, or None when the
    result has none (engine flag or request flag off)."""
    info = meta_info(result)
    payload = info.get("routed_experts")
    if payload is None:
        return None
    rows = int(info["prompt_tokens"]) + int(info["completion_tokens"]) - 1 - start_len
    return decode_routed_experts(payload, rows, num_layers)


def chat_routed_experts_payload(response: Result, index: int = 0) -> str | None:
    """The base64 routed experts of a chat response: in `choices[i].meta_info` with return_meta_info, else
    in the response-level `sglext` (first choice only)."""
    choice_info = response["choices"][index].get("meta_info") or {}
    if "routed_experts" in choice_info:
        return choice_info["routed_experts"]
    return (response.get("sglext") or {}).get("routed_experts")
