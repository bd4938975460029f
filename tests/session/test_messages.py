import pytest

from miles_runner.session.errors import MessageValidationError
from miles_runner.session.messages import matching_prefix_len, normalize_message, normalize_messages, template_view


def test_an_sdk_dumped_assistant_message_equals_the_plain_one():
    dumped = {"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "audio": None}
    assert normalize_message(dumped) == normalize_message({"role": "assistant", "content": "hi"})


def test_text_parts_are_joined_into_one_string():
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    assert normalize_message(parts)["content"] == "ab"


def test_tool_call_arguments_keep_their_wire_spelling_and_lose_the_stream_index():
    call = {"id": "c1", "type": "function", "index": 0, "function": {"name": "add", "arguments": '{"a": 1}'}}
    normalized = normalize_message({"role": "assistant", "content": None, "tool_calls": [call]})
    assert normalized["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]


def test_the_template_sees_json_text_arguments_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    message = normalize_message({"role": "assistant", "content": "", "tool_calls": [call]})
    assert template_view([message])[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert message["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the stored form is untouched


def test_a_message_without_a_role_is_a_validation_error():
    with pytest.raises(MessageValidationError, match="string role"):
        normalize_message({"content": "x"})


def test_an_empty_message_list_is_a_validation_error():
    with pytest.raises(MessageValidationError, match="non-empty list"):
        normalize_messages([])


def test_image_parts_are_rejected():
    with pytest.raises(MessageValidationError, match="only text content parts"):
        normalize_message({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})


def test_matching_prefix_stops_at_the_first_difference():
    stored = normalize_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    request = normalize_messages([{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}])
    assert matching_prefix_len(stored, request) == 1
