"""Malformed and invalid requests get a 400 naming the problem: never a 500, never a hang."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

IDS = [5, 6, 7]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

NATIVE_CASES = {
    "temperature_of_wrong_type": ({"input_ids": IDS, "sampling_params": {"temperature": "hot"}}, "temperature"),
    "negative_temperature": ({"input_ids": IDS, "sampling_params": {"temperature": -1}}, "temperature"),
    "top_p_above_one": ({"input_ids": IDS, "sampling_params": {"top_p": 1.5}}, "top_p"),
    "zero_top_k": ({"input_ids": IDS, "sampling_params": {"top_k": 0}}, "top_k"),
    "negative_max_new_tokens": ({"input_ids": IDS, "sampling_params": {"max_new_tokens": -2}}, "max_new_tokens"),
    "zero_n": ({"input_ids": IDS, "sampling_params": {"n": 0}}, "n must be"),
    "no_prompt": ({"sampling_params": {}}, "Exactly one of text, input_ids"),
    "text_and_input_ids": ({"text": "a", "input_ids": IDS}, "Exactly one of text, input_ids"),
    "input_ids_not_ints": ({"input_ids": ["a", "b"]}, "input_ids"),
    "empty_input_ids": ({"input_ids": []}, "empty"),
    "token_out_of_vocab": ({"input_ids": [5, 10**6]}, "out of the vocabulary"),
    "prompt_over_context": ({"input_ids": [5] * 5000}, "context length"),
    "routed_start_past_prompt": ({"input_ids": IDS, "routed_experts_start_len": 9}, "routed_experts_start_len"),
    "logprob_start_past_prompt": (
        {"input_ids": IDS, "return_logprob": True, "logprob_start_len": 3},
        "logprob_start_len",
    ),
    "lora_list_length_mismatch": ({"input_ids": [IDS, IDS], "lora_path": [None]}, "lora_path"),
    "rid_list_length_mismatch": ({"input_ids": [IDS, IDS], "rid": ["a"]}, "rid"),
    "constrained_decoding": ({"input_ids": IDS, "sampling_params": {"regex": "[0-9]+"}}, "Constrained decoding"),
    "custom_logit_processor": ({"input_ids": IDS, "custom_logit_processor": "x"}, "custom logit processor"),
}


@pytest.mark.parametrize("case", NATIVE_CASES, ids=list(NATIVE_CASES))
async def test_invalid_generate_body_is_400_naming_the_problem(client, case):
    body, expected = NATIVE_CASES[case]
    response = await client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"]


async def test_body_that_is_not_json_is_400(client):
    response = await client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "body" in response.json()["error"]["message"]


CHAT_CASES = {
    "missing_messages": ({"max_tokens": 2}, "messages"),
    "message_without_role": ({"messages": [{"content": "hi"}]}, "role"),
    "meta_info_with_stream": ({**CHAT, "stream": True, "return_meta_info": True}, "return_meta_info"),
    "token_ids_with_stream": ({**CHAT, "stream": True, "return_token_ids": True}, "return_token_ids"),
    "negative_temperature": ({**CHAT, "temperature": -0.5}, "temperature"),
}


@pytest.mark.parametrize("case", CHAT_CASES, ids=list(CHAT_CASES))
async def test_invalid_chat_body_is_an_openai_400(client, case):
    body, expected = CHAT_CASES[case]
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400 and expected in error["message"]


async def test_chat_body_with_a_non_json_media_type_is_400(client):
    response = await client.post("/v1/chat/completions", content=b"messages=hi", headers={"content-type": "text/plain"})
    assert response.status_code == 400


async def test_duplicate_in_flight_rid_is_400(client):
    long = {"input_ids": IDS, "rid": "dup-rid", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    first = asyncio.create_task(client.post("/generate", json=long))
    await asyncio.sleep(0.4)
    try:
        second = await client.post("/generate", json=long)
        assert second.status_code == 400 and "Duplicate request ID" in second.json()["error"]["message"]
    finally:
        await client.post("/abort_request", json={"rid": "dup-rid"})
        assert (await first).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pause_generation", {"mode": "sideways"}),
        ("/load_lora_adapter", {"lora_name": "x"}),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/adapter"}),
        (
            "/load_lora_adapter_from_tensors",
            {"lora_name": "x", "config_dict": {"r": 2}, "serialized_named_tensors": ["%%%"]},
        ),
        ("/update_weights_from_disk", {"model_path": "/no/such/model"}),
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["not base64 !"]}),
        ("/update_weight_version", {}),
        ("/abort_request", {"rid": 5, "abort_all": "maybe"}),
    ],
)
async def test_invalid_admin_body_is_400(client, path, body):
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text


async def test_unknown_model_card_is_404_model_not_found(client):
    response = await client.get("/v1/models/nope")
    assert response.status_code == 404 and response.json()["code"] == "model_not_found"
