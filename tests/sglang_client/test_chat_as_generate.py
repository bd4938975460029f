"""A chat turn as SGLang's /generate: the request serving_chat would adapt it to, and the reply it would build."""

import pytest

from miles_runner.sglang_client.chat_as_generate import chat_completion, generate_body, unsupported_chat_fields

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "input_ids": [5, 6, 7]}


def native(text: str = "12", **meta) -> dict:
    return {
        "text": text,
        "output_ids": [1, 2],
        "meta_info": {
            "id": "rid-1",
            "finish_reason": {"type": "stop", "matched": 2},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "weight_version": "7",
            "output_token_logprobs": [[-0.5, 1, "1"], [-0.25, 2, "2"]],
            **meta,
        },
    }


def test_chat_sampling_fields_take_sglangs_generate_names():
    body = generate_body({**CHAT, "max_tokens": 4, "seed": 3, "min_tokens": 1, "stop": ["\n"], "temperature": 0.5})
    assert body["input_ids"] == [5, 6, 7]
    assert body["sampling_params"] == {
        "max_new_tokens": 4,
        "sampling_seed": 3,
        "min_new_tokens": 1,
        "stop": ["\n"],
        "temperature": 0.5,
    }
    assert body["return_text_in_logprobs"] is True and body["stream"] is False


def test_an_unlimited_chat_turn_stays_unlimited_on_generate():
    # /generate would stop at 128 new tokens without max_new_tokens; chat generates up to the context.
    assert generate_body(CHAT)["sampling_params"]["max_new_tokens"] is None
    both = generate_body({**CHAT, "max_completion_tokens": 9, "max_tokens": 4})
    assert both["sampling_params"]["max_new_tokens"] == 9


def test_model_defaults_fill_only_what_the_request_leaves_unset():
    defaults = {"temperature": 0.6, "top_k": 20}
    params = generate_body({**CHAT, "temperature": 1.0}, model_defaults=defaults)["sampling_params"]
    assert params["temperature"] == 1.0 and params["top_k"] == 20


def test_rl_fields_are_carried_at_the_top_level():
    chat = {
        **CHAT,
        "logprobs": True,
        "top_logprobs": 2,
        "return_routed_experts": True,
        "routed_experts_start_len": 4,
        "lora_path": "slot",
        "rid": "a::1",
        "extra_key": "a:v1",
    }
    body = generate_body(chat)
    assert body["return_logprob"] is True and body["top_logprobs_num"] == 2
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 4)
    assert (body["lora_path"], body["rid"], body["extra_key"]) == ("slot", "a::1", "a:v1")


def test_the_adapter_named_in_model_wins_as_in_sglang():
    assert generate_body({**CHAT, "model": "base:other", "lora_path": "slot"})["lora_path"] == "other"


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stream": True}, "stream"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"return_token_ids": True}, "return_token_ids"),
    ],
)
def test_fields_it_cannot_carry_are_refused_by_name(extra, named):
    assert unsupported_chat_fields({**CHAT, **extra}) == [named]
    with pytest.raises(ValueError, match=named):
        generate_body({**CHAT, **extra})


def test_fields_without_effect_in_sglang_without_a_parser_are_accepted():
    assert unsupported_chat_fields({**CHAT, "tool_choice": "auto", "user": "u", "parallel_tool_calls": True}) == []


def test_the_reply_is_a_chat_completion_with_usage_logprobs_and_meta_info():
    reply = chat_completion([native()], model="tiny", logprobs=True, return_meta_info=True)
    [choice] = reply["choices"]
    assert reply["id"] == "rid-1" and reply["object"] == "chat.completion" and reply["model"] == "tiny"
    assert choice["message"]["content"] == "12" and choice["message"]["role"] == "assistant"
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", 2)
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert choice["meta_info"]["output_token_logprobs"] == native()["meta_info"]["output_token_logprobs"]
    assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5, "reasoning_tokens": 0}
    assert reply["metadata"] == {"weight_version": "7"}


def test_routed_experts_go_to_sglext_only_without_meta_info():
    item = native(routed_experts="AAAA")
    assert chat_completion([item], model="m", logprobs=False, return_meta_info=False)["sglext"] == {
        "routed_experts": "AAAA"
    }
    with_meta = chat_completion([item], model="m", logprobs=False, return_meta_info=True)
    assert "sglext" not in with_meta and with_meta["choices"][0]["meta_info"]["routed_experts"] == "AAAA"
