"""A turn is generated as SGLang's /generate: chat fields it cannot carry are refused by name, never dropped,
and no field of the agent's can swap the session's adapter for another."""

import httpx
import pytest
from servers import chat, get_session, new_session

from miles_runner.session.config import SessionServerConfig, read_sampling_defaults
from miles_runner.session.errors import MessageValidationError
from miles_runner.session.request import prepare_chat_request

pytestmark = pytest.mark.integration

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
WITH_ADAPTER = SessionServerConfig(engine_url="http://127.0.0.1:1", model_path="unused", lora_name="miles_lora")


@pytest.mark.parametrize("field", ["response_format", "logit_processor_args", "return_token_ids"])
def test_a_chat_field_the_turn_cannot_carry_is_refused_by_name(field):
    with pytest.raises(MessageValidationError, match=field):
        prepare_chat_request({**BODY, field: {"type": "json_object"}}, WITH_ADAPTER, None)


def test_a_model_naming_another_adapter_is_refused():
    with pytest.raises(MessageValidationError, match="names the adapter 'other'"):
        prepare_chat_request({**BODY, "model": "tiny:other"}, WITH_ADAPTER, None)


def test_a_model_naming_the_sessions_own_adapter_is_accepted():
    upstream, _ = prepare_chat_request({**BODY, "model": "tiny:miles_lora"}, WITH_ADAPTER, None)
    assert upstream["lora_path"] == "miles_lora"


def test_sampling_defaults_are_the_values_generation_config_sets(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_k": 20, "eos_token_id": 2}')
    assert read_sampling_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20}
    assert read_sampling_defaults(tmp_path / "missing") == {}


def test_a_refused_field_is_a_400_that_leaves_the_session_unchanged(lora_server):
    session_id = new_session(lora_server)
    assert chat(lora_server, session_id, BODY["messages"]).status_code == 200
    before = get_session(lora_server, session_id)
    reply = chat(lora_server, session_id, BODY["messages"], response_format={"type": "json_object"})
    assert reply.status_code == 400
    assert "response_format" in reply.json()["error"]
    assert get_session(lora_server, session_id) == before
    assert httpx.delete(f"{lora_server.url}/sessions/{session_id}", trust_env=False).status_code == 204
