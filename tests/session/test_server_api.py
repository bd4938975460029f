"""The HTTP surface of the session server (docs/system.md §2.2, §2.3), against the embedded engine on loopback."""

import httpx
import pytest
from servers import chat, get_session, new_session, openai_client

from miles_runner.session.codec import decode_samples

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "What is 3 plus 4?"}


def test_health_reports_the_instance_id(lora_server):
    assert httpx.get(f"{lora_server.url}/health").json() == {"status": "ok", "session_server_instance_id": "i-1"}


def test_a_new_session_is_empty(lora_server):
    session = get_session(lora_server, new_session(lora_server))
    assert session["records"] == []
    assert session["metadata"] == {"accumulated_token_ids": [], "max_trim_tokens": 0}


def test_an_unknown_session_is_404_everywhere(lora_server):
    base = f"{lora_server.url}/sessions/nope"
    assert httpx.get(base).status_code == 404
    assert httpx.delete(base).status_code == 404
    assert chat(lora_server, "nope", [USER]).json() == {"error": "session nope not found"}
    assert httpx.post(f"{base}/samples", json={}).status_code == 404


def test_delete_removes_the_session_and_a_second_delete_is_404(lora_server):
    session_id = new_session(lora_server)
    assert httpx.delete(f"{lora_server.url}/sessions/{session_id}").status_code == 204
    assert httpx.delete(f"{lora_server.url}/sessions/{session_id}").status_code == 404
    assert chat(lora_server, session_id, [USER]).status_code == 404


def test_a_turn_appends_one_record_with_the_full_upstream_exchange(lora_server):
    session_id = new_session(lora_server)
    reply = chat(lora_server, session_id, [USER])
    assert reply.status_code == 200
    session = get_session(lora_server, session_id)
    [record] = session["records"]
    prompt_ids = record["request"]["input_ids"]
    assert session["metadata"]["accumulated_token_ids"][: len(prompt_ids)] == prompt_ids
    assert record["request"]["logprobs"] is True and record["request"]["return_meta_info"] is True
    assert record["status_code"] == 200 and record["path"] == "/v1/chat/completions"
    assert "routed_experts" in record["response"]["choices"][0]["meta_info"]
    assert "routed_experts" not in reply.json()["choices"][0]["meta_info"]


def test_the_reply_has_one_server_and_one_date_header(lora_server):
    reply = chat(lora_server, new_session(lora_server), [USER])
    assert len(reply.headers.get_list("server")) <= 1
    assert len(reply.headers.get_list("date")) == 1


def test_invalid_json_is_400(lora_server):
    session_id = new_session(lora_server)
    reply = httpx.post(f"{lora_server.url}/sessions/{session_id}/v1/chat/completions", content=b"{not json")
    assert reply.status_code == 400
    assert reply.json()["error"].startswith("invalid JSON body")


def test_a_message_without_role_is_400_not_500(lora_server):
    reply = chat(lora_server, new_session(lora_server), [{"content": "x"}])
    assert reply.status_code == 400


def test_an_engine_error_passes_through_unrecorded(lora_server):
    session_id = new_session(lora_server)
    reply = chat(lora_server, session_id, [USER], max_tokens=-5)
    assert 400 <= reply.status_code < 500
    assert get_session(lora_server, session_id)["records"] == []


def test_other_paths_are_proxied_to_the_engine_and_not_recorded(lora_server):
    session_id = new_session(lora_server)
    models = httpx.get(f"{lora_server.url}/sessions/{session_id}/v1/models")
    assert models.status_code == 200
    assert "miles_lora" in [card["id"] for card in models.json()["data"]]
    assert get_session(lora_server, session_id)["records"] == []


def test_samples_is_served_by_the_session_server_not_proxied(lora_server):
    session_id = new_session(lora_server)
    reply = httpx.post(f"{lora_server.url}/sessions/{session_id}/samples", json={"max_seq_len": None})
    assert reply.headers["content-type"] == "application/octet-stream"
    assert decode_samples(reply.content).empty_reason == "no_records"


def test_samples_metadata_equals_the_get_metadata(lora_server):
    session_id = new_session(lora_server)
    chat(lora_server, session_id, [USER])
    reply = decode_samples(httpx.post(f"{lora_server.url}/sessions/{session_id}/samples", json={}).content)
    assert reply.session_metadata == get_session(lora_server, session_id)["metadata"]
    assert reply.samples[0].tokens == reply.session_metadata["accumulated_token_ids"]


def test_a_bad_max_seq_len_is_400(lora_server):
    session_id = new_session(lora_server)
    reply = httpx.post(f"{lora_server.url}/sessions/{session_id}/samples", json={"max_seq_len": "long"})
    assert reply.status_code == 400


def test_the_openai_sdk_streams_one_chunk_with_content_and_usage(lora_server):
    session_id = new_session(lora_server)
    stream = openai_client(lora_server, session_id).chat.completions.create(
        model="tiny", messages=[USER], max_tokens=4, temperature=0, stream=True
    )
    chunks = list(stream)
    [record] = get_session(lora_server, session_id)["records"]
    assert len(chunks) == 1
    assert chunks[0].choices[0].delta.content == record["response"]["choices"][0]["message"]["content"]
    assert chunks[0].usage.completion_tokens == record["response"]["usage"]["completion_tokens"]


def test_an_adapter_slot_session_sends_rid_and_extra_key(lora_server):
    adapter = {"name": "tenant-a", "lora_name": "__miles_slot_0", "version": 3}
    session_id = new_session(lora_server, adapter=adapter)
    assert chat(lora_server, session_id, [USER]).status_code == 200
    [record] = get_session(lora_server, session_id)["records"]
    assert record["request"]["lora_path"] == "__miles_slot_0"
    assert record["request"]["rid"].startswith("tenant-a::")
    assert record["request"]["extra_key"] == "tenant-a:v3"


def test_a_malformed_adapter_slot_is_400(lora_server):
    reply = httpx.post(f"{lora_server.url}/sessions", json={"adapter": {"name": "a::b", "lora_name": "x"}})
    assert reply.status_code == 400


def test_the_openapi_schema_documents_each_routes_real_answers(lora_server):
    paths = httpx.get(f"{lora_server.url}/openapi.json").json()["paths"]
    chat = paths["/sessions/{session_id}/v1/chat/completions"]["post"]
    assert {"400", "404", "409", "502", "503", "4XX"} <= set(chat["responses"])
    assert set(chat["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    assert chat["requestBody"]["content"]["application/json"]["schema"]["required"] == ["messages"]
    samples = paths["/sessions/{session_id}/samples"]["post"]["responses"]
    assert list(samples["200"]["content"]) == ["application/octet-stream"]
    assert list(samples["422"]["content"]) == ["text/plain"]
    assert "429" in paths["/sessions"]["post"]["responses"]
    assert "422" not in paths["/sessions/{session_id}"]["get"]["responses"]  # no FastAPI validation can fail
    assert not [path for path in paths if "server_info" in path or "{path" in path]  # an allow-list, no catch-all
