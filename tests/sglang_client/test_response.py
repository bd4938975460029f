"""Reading SGLang results: tokens and logprobs, finish reasons, fallbacks, routed experts."""

from __future__ import annotations

import numpy as np
import pytest

from miles_runner.sglang_client import response as res
from miles_runner.sglang_client.routed_experts import encode_routed_experts


def result(**meta: object) -> dict:
    return {"text": "", "output_ids": [5, 6], "meta_info": meta}


def test_tokens_and_logprobs_come_from_output_token_logprobs() -> None:
    triples = [[-0.5, 5, None], [-1.25, 6, None]]
    assert res.output_token_logprobs(result(output_token_logprobs=triples)) == ([5, 6], [-0.5, -1.25])


def test_missing_logprobs_say_how_to_request_them() -> None:
    with pytest.raises(ValueError, match="return_logprob"):
        res.output_token_logprobs(result())


def test_chat_choice_without_meta_info_says_how_to_request_it() -> None:
    with pytest.raises(ValueError, match="return_meta_info"):
        res.meta_info({"index": 0, "message": {"content": ""}})


def test_abort_is_recognised_from_finish_reason_type() -> None:
    aborted = result(finish_reason={"type": "abort", "message": "Abort in waiting queue"})
    assert res.is_aborted(aborted) and res.finish_reason_type(aborted) == "abort"
    assert res.finish_reason_type(result(finish_reason=None)) is None


def test_prompt_tokens_fall_back_to_the_prompt_for_results_aborted_in_queue() -> None:
    assert res.prompt_tokens(result(finish_reason={"type": "abort"}), [1, 2, 3]) == 3
    assert res.prompt_tokens(result(prompt_tokens=7), [1, 2, 3]) == 7


def test_routed_experts_decode_to_rows_of_forwarded_tokens() -> None:
    experts = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 8
    done = result(prompt_tokens=3, completion_tokens=2, routed_experts=encode_routed_experts(experts))
    assert (res.routed_experts(done, num_layers=2) == experts).all()
    assert res.routed_experts(result(prompt_tokens=3, completion_tokens=2), num_layers=2) is None


def test_chat_routed_experts_prefer_choice_meta_info_over_sglext() -> None:
    in_choice = {"choices": [{"meta_info": {"routed_experts": "AAAA"}}], "sglext": {"routed_experts": "BBBB"}}
    in_sglext = {"choices": [{"message": {}}], "sglext": {"routed_experts": "BBBB"}}
    assert res.chat_routed_experts_payload(in_choice) == "AAAA"
    assert res.chat_routed_experts_payload(in_sglext) == "BBBB"
    assert res.chat_routed_experts_payload({"choices": [{}]}) is None
