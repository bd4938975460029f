"""Faults: an engine that is down or too slow gives 502 and the session stays usable; records that cannot
make a sample give 422 and the server keeps serving."""

import httpx
import pytest
from servers import FaultInjectingUpstream, chat, get_session, new_session

pytestmark = pytest.mark.integration

USER = {"role": "user", "content": "What is 3 plus 4?"}


@pytest.fixture()
def upstream(engine_url):
    proxy = FaultInjectingUpstream(engine_url).start()
    yield proxy
    proxy.hanging = False
    proxy.stop()


def follow_up(server, session_id: str) -> list[dict]:
    [record] = get_session(server, session_id)["records"]
    content = record["response"]["choices"][0]["message"]["content"]
    return [USER, {"role": "assistant", "content": content}, {"role": "user", "content": "Thank you!"}]


def test_an_engine_that_is_down_gives_502_and_the_session_stays_usable(upstream, start_session_server):
    server = start_session_server(upstream.url, upstream_timeout_s=5)
    session_id = new_session(server)
    assert chat(server, session_id, [USER]).status_code == 200
    upstream.stop()
    down = chat(server, session_id, follow_up(server, session_id))
    assert down.status_code == 502
    assert down.json()["error"].startswith("backend transport error")
    upstream.start()
    assert chat(server, session_id, follow_up(server, session_id)).status_code == 200
    assert len(get_session(server, session_id)["records"]) == 2


def test_an_engine_that_times_out_gives_502_and_the_session_stays_usable(upstream, start_session_server):
    server = start_session_server(upstream.url, upstream_timeout_s=3)
    session_id = new_session(server)
    upstream.hanging = True
    slow = chat(server, session_id, [USER])
    assert slow.status_code == 502
    assert "timed out" in slow.json()["error"]
    upstream.hanging = False
    again = chat(server, session_id, [USER])
    assert again.status_code == 200, again.text
    assert len(get_session(server, session_id)["records"]) == 1


def test_the_proxy_route_reports_an_unreachable_engine_as_502(upstream, start_session_server):
    server = start_session_server(upstream.url, upstream_timeout_s=5)
    session_id = new_session(server)
    upstream.stop()
    reply = httpx.get(f"{server.url}/sessions/{session_id}/v1/models")
    upstream.start()
    assert reply.status_code == 502


def two_turn_session(server) -> tuple[str, object]:
    """A finished two-turn session and its in-process state, for injecting faults into its records."""
    session_id = new_session(server)
    chat(server, session_id, [USER])
    chat(server, session_id, follow_up(server, session_id))
    return session_id, server.app.state.core.sessions[session_id].state


def samples(server, session_id: str) -> httpx.Response:
    return httpx.post(f"{server.url}/sessions/{session_id}/samples", json={})


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("gap", "incremental R3: turn 1 starts at row"),
        ("overlap", "incremental R3: turn 1 starts at row"),
        ("missing_payload", "incremental R3: turn 1 has no routed_experts payload"),
        ("missing_start", "incremental R3: turn 1 was sent without routed_experts_start_len"),
        ("row_count", "R3: turn 1"),
    ],
)
def test_a_broken_r3_chain_is_422_naming_the_turn_and_the_server_survives(lora_server, fault, message):
    session_id, state = two_turn_session(lora_server)
    record = state.records[1]
    meta = record.response["choices"][0]["meta_info"]
    if fault in ("gap", "overlap"):
        record.request["routed_experts_start_len"] += 2 if fault == "gap" else -2
    elif fault == "missing_payload":
        del meta["routed_experts"]
    elif fault == "missing_start":
        del record.request["routed_experts_start_len"]
    else:
        meta["routed_experts"] = meta["routed_experts"][:-8]  # drop one int32 pair: a wrong value count
    reply = samples(lora_server, session_id)
    assert reply.status_code == 422
    assert reply.headers["content-type"].startswith("text/plain")
    assert message in reply.text
    assert httpx.get(f"{lora_server.url}/health").status_code == 200
    assert samples(lora_server, two_turn_session(lora_server)[0]).status_code == 200


def test_a_broken_token_chain_is_422(lora_server):
    session_id, state = two_turn_session(lora_server)
    state.records[1].request["input_ids"][0] += 1
    reply = samples(lora_server, session_id)
    assert reply.status_code == 422
    assert "turn 1: its prompt" in reply.text
