"""Builders of engine replies and session records as the engine would produce them (plain data, no server)."""

from __future__ import annotations

import numpy as np

from miles_runner.session.records import SessionRecord
from miles_runner.sglang_client.routed_experts import encode_routed_experts

NUM_LAYERS = 2
TOPK = 2


def routing_rows(num_rows: int, *, seed: int = 0, offset: int = 0) -> np.ndarray:
    """Deterministic routing rows: row r of a sequence is the same whichever patch carries it."""
    rows = np.arange(offset, offset + num_rows, dtype=np.int32)[:, None, None]
    return ((rows * 7 + seed + np.arange(NUM_LAYERS * TOPK).reshape(1, NUM_LAYERS, TOPK)) % 8).astype(np.int32)


def make_response(
    completion_ids: list[int],
    *,
    content: str | None = "ok",
    finish_reason: str = "stop",
    routed: np.ndarray | None = None,
    weight_version: str = "default",
    cached_tokens: int = 0,
) -> dict:
    meta = {
        "output_token_logprobs": [[-0.5 - i / 10, token, None] for i, token in enumerate(completion_ids)],
        "weight_version": weight_version,
        "cached_tokens": cached_tokens,
        "completion_tokens": len(completion_ids),
    }
    if routed is not None:
        meta["routed_experts"] = encode_routed_experts(routed)
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
                "meta_info": meta,
            }
        ],
        "usage": {"prompt_tokens": 0, "completion_tokens": len(completion_ids)},
    }


def make_record(
    prompt_ids: list[int],
    completion_ids: list[int],
    *,
    start_len: int | None = None,
    routed: np.ndarray | None = None,
    finish_reason: str = "stop",
    **response_fields,
) -> SessionRecord:
    request = {"messages": [], "input_ids": list(prompt_ids)}
    if start_len is not None:
        request["routed_experts_start_len"] = start_len
    response = make_response(completion_ids, routed=routed, finish_reason=finish_reason, **response_fields)
    return SessionRecord(1.0, 0.5, "POST", "/v1/chat/completions", request, response, 200)


def incremental_records(turns: list[tuple[list[int], list[int]]]) -> list[SessionRecord]:
    """Records of a chain of (prompt, completion) turns, each carrying only the rows after its checkpoint."""
    records = []
    previous_len = 0
    for prompt, completion in turns:
        start = max(0, previous_len - 1)
        end = len(prompt) + len(completion) - 1
        routed = routing_rows(end - start, offset=start)
        records.append(make_record(prompt, completion, start_len=start, routed=routed))
        previous_len = len(prompt) + len(completion)
    return records


def plan_and_complete(state, tito, messages, answer, *, finish_reason="stop"):
    """Plan a turn on a v1/v2 state and build what the engine would return for `answer` (not committed)."""
    from miles_runner.session.messages import normalize_message, normalize_messages

    plan = state.plan_turn(normalize_messages(messages), None, {}, tito)
    completion = tito.encode(answer)
    if finish_reason == "stop":
        completion.append(tito.tokenizer.convert_tokens_to_ids("<|im_end|>"))
    record = make_record(plan.prompt_ids, completion, content=answer, finish_reason=finish_reason)
    assistant = normalize_message({"role": "assistant", "content": answer})
    return plan, completion, assistant, record


def play_turn(state, tito, messages, answer, *, finish_reason="stop"):
    plan, completion, assistant, record = plan_and_complete(state, tito, messages, answer, finish_reason=finish_reason)
    assert state.commit(plan, completion, assistant, record, 0)
    return plan
