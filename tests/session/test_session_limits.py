"""Session lifecycle limits: one v1 turn at a time (409, never a lost 200), DELETE aborts the
in-flight turn on the engine, a cap on open sessions (429) and an age limit (404, resources freed)."""

import asyncio

import httpx
import pytest
from servers import STOP_TOKEN_IDS, FaultInjectingUpstream, chat, new_session

from miles_testkit.servers import RecordingProxy

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

USER = {"role": "user", "content": "Tell me a long story."}
# Long enough to still be generating while the other requests arrive (ended early by an abort).
LONG_TURN = {"model": "tiny", "messages": [USER], "max_tokens": 1500, "temperature": 0, "ignore_eos": True}


async def wait_until_in_flight(server, session_id: str) -> str:
    """The rid of the session's turn once the server has sent it to the engine (polls the server's state)."""
    session = server.app.state.core.sessions[session_id]
    while not session.in_flight:
        await asyncio.sleep(0.01)
    return next(iter(session.in_flight))


async def test_concurrent_turns_on_one_v1_session_get_409_and_every_200_is_recorded(base_server):
    session_id = new_session(base_server)
    url = f"{base_server.url}/sessions/{session_id}/v1/chat/completions"
    body = {**LONG_TURN, "max_tokens": 300}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        first = asyncio.create_task(http.post(url, json=body))
        await wait_until_in_flight(base_server, session_id)
        others = await asyncio.gather(*(http.post(url, json=body) for _ in range(9)))
        replies = [await first, *others]
    assert [r.status_code for r in replies] == [200] + [409] * 9
    assert "one turn at a time" in replies[1].json()["error"]
    records = httpx.get(f"{base_server.url}/sessions/{session_id}").json()["records"]
    assert [r["response"]["id"] for r in records] == [replies[0].json()["id"]]
    assert chat(base_server, session_id, [USER]).status_code == 200  # the session takes the next turn


async def test_delete_during_a_turn_aborts_it_on_the_engine(engine_url, start_session_server):
    with RecordingProxy(engine_url) as engine:
        server = start_session_server(engine.url)
        session_id = new_session(server)
        async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
            turn = asyncio.create_task(
                http.post(f"{server.url}/sessions/{session_id}/v1/chat/completions", json=LONG_TURN)
            )
            rid = await wait_until_in_flight(server, session_id)
            assert (await http.delete(f"{server.url}/sessions/{session_id}")).status_code == 204
            reply = await turn
        sent = [(r.path, r.body) for r in engine.sent]
    assert ("/abort_request", {"rid": rid, "abort_all": False}) in sent
    assert reply.status_code == 404  # the agent's request ended: aborted, and not recorded
    assert session_id not in server.app.state.core.sessions


async def test_delete_answers_even_when_the_engine_hangs(engine_url, start_session_server):
    upstream = FaultInjectingUpstream(engine_url).start()
    upstream.hanging = True  # the turn and the abort both hang
    try:
        server = start_session_server(upstream.url, upstream_timeout_s=6)
        session_id = new_session(server)
        async with httpx.AsyncClient(timeout=60, trust_env=False) as http:
            turn = asyncio.create_task(
                http.post(f"{server.url}/sessions/{session_id}/v1/chat/completions", json=LONG_TURN)
            )
            await wait_until_in_flight(server, session_id)
            deleted = await http.delete(f"{server.url}/sessions/{session_id}")
            assert not turn.done()  # DELETE answered while the turn still waits on the engine
            reply = await turn
    finally:
        upstream.hanging = False
        upstream.stop()
    assert deleted.status_code == 204
    assert reply.status_code in (404, 502)  # deleted, or the engine timed out: never recorded


def test_more_sessions_than_the_cap_is_429_naming_the_setting(engine_url, start_session_server):
    server = start_session_server(engine_url, max_sessions=2)
    first, _ = new_session(server), new_session(server)
    refused = httpx.post(f"{server.url}/sessions")
    assert refused.status_code == 429
    assert "session.max_sessions=2" in refused.json()["error"]
    assert httpx.delete(f"{server.url}/sessions/{first}").status_code == 204
    assert httpx.post(f"{server.url}/sessions").status_code == 200  # a deleted session frees its place


def test_an_expired_session_is_gone_and_its_resources_freed(engine_url, start_session_server):
    server = start_session_server(engine_url, max_age_s=60.0, max_sessions=1)
    core = server.app.state.core
    session_id = new_session(server)
    assert chat(server, session_id, [USER], max_tokens=2, stop_token_ids=STOP_TOKEN_IDS).status_code == 200
    assert core.upstream.pinned(session_id) is not None
    core.sessions[session_id].created_at -= 61.0  # as if a minute had passed
    assert httpx.get(f"{server.url}/sessions/{session_id}").status_code == 404
    assert chat(server, session_id, [USER]).status_code == 404
    assert httpx.post(f"{server.url}/sessions").status_code == 200  # the expired one no longer counts
    assert session_id not in core.sessions and core.upstream.pinned(session_id) is None
