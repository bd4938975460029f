import json

import pytest
from session_records import make_response, routing_rows

from miles_runner.session.config import AdapterSlot, SessionServerConfig
from miles_runner.session.errors import MessageValidationError, UpstreamResponseError
from miles_runner.session.request import (
    extract_completion,
    fake_stream,
    prepare_chat_request,
    strip_replay_payloads,
)

CONFIG = SessionServerConfig(engine_url="http://127.0.0.1:1", model_path="unused")
BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_the_server_forces_logprobs_meta_info_and_stop_tokens():
    upstream, stream = prepare_chat_request({**BODY, "stream": True, "stream_options": {}}, CONFIG, None)
    assert stream is True
    assert "stream" not in upstream and "stream_options" not in upstream
    assert upstream["logprobs"] is True and upstream["return_meta_info"] is True
    assert upstream["no_stop_trim"] is False


def test_the_configured_adapter_overrides_the_agents_lora_path():
    config = SessionServerConfig(engine_url="http://127.0.0.1:1", model_path="unused", lora_name="miles_lora")
    upstream, _ = prepare_chat_request({**BODY, "lora_path": "something_else"}, config, None)
    assert upstream["lora_path"] == "miles_lora"


def test_without_an_adapter_no_lora_path_is_added():
    upstream, _ = prepare_chat_request(BODY, CONFIG, None)
    assert "lora_path" not in upstream


def test_an_adapter_slot_sets_lora_path_rid_and_extra_key():
    upstream, _ = prepare_chat_request(BODY, CONFIG, AdapterSlot("tenant-a", "__miles_slot_3", 7))
    assert upstream["lora_path"] == "__miles_slot_3"
    assert upstream["rid"].startswith("tenant-a::") and len(upstream["rid"]) > len("tenant-a::")
    assert upstream["extra_key"] == "tenant-a:v7"


def test_routing_replay_is_requested_when_configured():
    config = SessionServerConfig(engine_url="http://x", model_path="m", return_routed_experts=True)
    assert prepare_chat_request(BODY, config, None)[0]["return_routed_experts"] is True


def test_more_than_one_choice_is_rejected():
    with pytest.raises(MessageValidationError, match="n must be 1"):
        prepare_chat_request({**BODY, "n": 2}, CONFIG, None)


def test_non_object_template_kwargs_are_rejected():
    with pytest.raises(MessageValidationError, match="chat_template_kwargs"):
        prepare_chat_request({**BODY, "chat_template_kwargs": [1]}, CONFIG, None)


def test_replay_payloads_are_stripped_from_a_copy():
    response = make_response([5, 6], routed=routing_rows(3))
    response["sglext"] = {"routed_experts": "abc", "cached_tokens_details": {}}
    reply = strip_replay_payloads(response)
    assert "routed_experts" not in reply["choices"][0]["meta_info"]
    assert reply["sglext"] == {"cached_tokens_details": {}}
    assert "routed_experts" in response["choices"][0]["meta_info"]


def test_extract_returns_token_ids_and_the_assistant_message():
    ids, assistant = extract_completion(make_response([5, 6], content="hi"))
    assert ids == [5, 6]
    assert assistant == {"role": "assistant", "content": "hi"}


def test_a_reply_without_output_logprobs_is_a_bad_gateway():
    response = make_response([5])
    del response["choices"][0]["meta_info"]["output_token_logprobs"]
    with pytest.raises(UpstreamResponseError, match="output_token_logprobs"):
        extract_completion(response)


def test_null_content_is_a_bad_gateway():
    with pytest.raises(UpstreamResponseError, match="null message content"):
        extract_completion(make_response([5], content=None))


def test_a_logprob_count_that_disagrees_with_usage_is_a_bad_gateway():
    response = make_response([5, 6])
    response["usage"]["completion_tokens"] = 3
    with pytest.raises(UpstreamResponseError, match=r"2 output logprobs but usage\.completion_tokens=3"):
        extract_completion(response)


def test_the_fake_stream_is_one_chunk_then_done_with_tool_call_indices():
    response = make_response([5], content="")
    response["choices"][0]["message"]["tool_calls"] = [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    events = list(fake_stream(response))
    assert events[-1] == "data: [DONE]\n\n"
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk"
    assert [call["index"] for call in chunk["choices"][0]["delta"]["tool_calls"]] == [0, 1]
    assert chunk["choices"][0]["finish_reason"] == "stop"
    assert chunk["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize(("field", "value"), [("model", ["tiny"]), ("stream", "yes"), ("stream_options", 1)])
def test_a_field_the_server_reads_with_the_wrong_type_is_a_400_naming_it(field, value):
    with pytest.raises(MessageValidationError, match=f"^{field} must be"):
        prepare_chat_request({"messages": [{"role": "user", "content": "hi"}], field: value}, CONFIG, None)
