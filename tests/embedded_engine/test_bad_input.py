"""Malformed and invalid requests get a 400 naming the problem: never a 500, never a hang."""

from __future__ import annotations

import asyncio
import json

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


SEGMENT_HANDLES = {  # base64 of shared-memory handles (sglang_client/tensor_shm.py) that must not reach any file
    "escape": ("bWlsZXMtc2htOi4uLy4uL2V0Yy9wYXNzd2Q=", "not a tensor segment name"),  # miles-shm:../../etc/passwd
    "missing": ("bWlsZXMtc2htOm1pbGVzLXRlbnNvcnMtMS0wMDAwMDAwMDAwMDAwMDAw", "cannot be opened here"),
}


@pytest.mark.parametrize("handle", list(SEGMENT_HANDLES))
@pytest.mark.parametrize("path", ["/load_lora_adapter_from_tensors", "/update_weights_from_tensor"])
async def test_a_tensor_handle_to_no_segment_of_ours_is_400_naming_why(client, path, handle):
    entry, why = SEGMENT_HANDLES[handle]
    body = {"serialized_named_tensors": [entry]}
    if path == "/load_lora_adapter_from_tensors":
        body |= {"lora_name": "handle_probe", "config_dict": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}
    response = await client.post(path, json=body)
    assert response.status_code == 400 and why in response.text, response.text


async def test_unknown_model_card_is_404_model_not_found(client):
    response = await client.get("/v1/models/nope")
    assert response.status_code == 404 and response.json()["code"] == "model_not_found"


# ----- inputs a lax parser answers with a 500 (closing the keep-alive connection) -------------------------------------
TWO = [IDS, IDS]
FORMER_500_CASES = {
    "sampling_params_list_for_one_prompt": (
        {"input_ids": IDS, "sampling_params": [{"max_new_tokens": 2}]},
        "sampling_params",
    ),
    "return_logprob_list_for_one_prompt": ({"input_ids": IDS, "return_logprob": [True]}, "return_logprob"),
    "sampling_params_shorter_than_batch": ({"input_ids": TWO, "sampling_params": [{}]}, "sampling_params"),
    "return_logprob_shorter_than_batch": ({"input_ids": TWO, "return_logprob": [True]}, "return_logprob"),
    "logprob_start_len_shorter_than_batch": ({"input_ids": TWO, "logprob_start_len": [0]}, "logprob_start_len"),
    "top_logprobs_num_shorter_than_batch": ({"input_ids": TWO, "top_logprobs_num": [1]}, "top_logprobs_num"),
    "token_ids_logprob_shorter_than_batch": (
        {"input_ids": TWO, "return_logprob": True, "token_ids_logprob": [[1]]},
        "token_ids_logprob",
    ),
    "n_above_max_n": ({"input_ids": IDS, "sampling_params": {"n": 257, "max_new_tokens": 1}}, "engine.max_n"),
    "batch_above_max_batch_size": (
        {"input_ids": [IDS] * 17, "sampling_params": {"n": 256, "max_new_tokens": 1}},
        "engine.max_batch_size",
    ),
    "too_many_stop_strings": ({"input_ids": IDS, "sampling_params": {"stop": ["x"] * 33}}, "stop strings"),
    "seed_out_of_range": ({"input_ids": IDS, "sampling_params": {"sampling_seed": 2**64}}, "sampling_seed"),
}


def _kept_alive(response) -> bool:
    return response.headers.get("connection", "").lower() != "close"


@pytest.mark.reliability
@pytest.mark.parametrize("case", FORMER_500_CASES, ids=list(FORMER_500_CASES))
async def test_inputs_that_were_500s_are_400s_naming_the_field(client, case):
    body, expected = FORMER_500_CASES[case]
    response = await client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    assert expected in response.json()["error"]["message"] and _kept_alive(response)


@pytest.mark.reliability
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({**CHAT, "n": 257}, "engine.max_n"),
        ({**CHAT, "temperature": float("inf")}, "temperature"),
        ({**CHAT, "top_logprobs": -1, "logprobs": True}, "top_logprobs must"),
    ],
    ids=["n_above_max_n", "infinite_temperature", "negative_top_logprobs"],
)
async def test_chat_inputs_that_were_500s_are_400s(client, body, expected):
    response = await client.post(
        "/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert expected in response.json()["message"] and _kept_alive(response)


@pytest.mark.reliability
async def test_chat_at_temperature_zero_is_greedy(client):
    """rollout.temperature=0 in an agentic run: SGLang samples greedily; so does the engine (same text twice)."""
    body = {**CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "return_meta_info": True}
    first, second = [await client.post("/v1/chat/completions", json=body) for _ in range(2)]
    assert first.status_code == second.status_code == 200, first.text
    assert first.json()["choices"][0]["message"] == second.json()["choices"][0]["message"]


@pytest.fixture(scope="module")
def bad_adapter_dirs(adapter_dirs, tmp_path_factory) -> dict[str, str]:
    """Adapter folders whose adapter_config.json is broken in the ways a hand-edited or truncated file is."""
    import shutil

    root = tmp_path_factory.mktemp("bad_adapters")
    configs = {
        "not_json": "{r: 4",
        "not_an_object": "[1, 2]",
        "rank_not_an_int": '{"r": "four", "target_modules": ["q_proj"]}',
        "rank_null": '{"r": null, "target_modules": ["q_proj"]}',
        "targets_not_strings": '{"r": 4, "target_modules": [1, 2]}',
        "peft_refuses_it": '{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "peft_type": "NOT_A_PEFT_TYPE"}',
    }
    folders = {}
    for name, text in configs.items():
        folder = root / name
        shutil.copytree(adapter_dirs["attn_b"], folder)
        (folder / "adapter_config.json").write_text(text)
        folders[name] = str(folder)
    return folders


@pytest.mark.reliability
@pytest.mark.parametrize(
    "case", ["not_json", "not_an_object", "rank_not_an_int", "rank_null", "targets_not_strings", "peft_refuses_it"]
)
async def test_an_invalid_adapter_config_is_a_400(client, bad_adapter_dirs, case):
    response = await client.post(
        "/load_lora_adapter", json={"lora_name": f"bad_{case}", "lora_path": bad_adapter_dirs[case]}
    )
    assert response.status_code == 400, response.text
    assert not response.json()["success"] and "adapter" in response.json()["error_message"] and _kept_alive(response)
    assert f"bad_{case}" not in response.json()["loaded_adapters"]


@pytest.mark.reliability
@pytest.mark.parametrize("name", ["a.b", "..", "", " padded", "base:adapter", "tab\there"])
async def test_an_invalid_adapter_name_is_a_400_naming_lora_name(client, adapter_dirs, name):
    from_path = await client.post(
        "/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs["attn_b"])}
    )
    from_tensors = await client.post(
        "/load_lora_adapter_from_tensors",
        json={"lora_name": name, "config_dict": {"r": 2}, "serialized_named_tensors": ["e30="]},
    )
    for response in (from_path, from_tensors):
        assert response.status_code == 400, response.text
        assert "lora_name" in response.json()["error_message"] and _kept_alive(response)
