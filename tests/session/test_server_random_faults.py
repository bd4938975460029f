"""The session server under 64 sessions x 10 turns against an engine that fails at random: every turn
that answered 200 is in its session's records, in order; every other answer is a clean 4xx/5xx with a body
that says why; nothing hangs. The failing engine is the real embedded engine behind `RandomFaultUpstream`, an
injected fault (seeded): engine 500/503, a 200 that is not JSON or lacks meta_info, a reply lost after the
engine generated, a body cut mid-way, and a hang past the session server's upstream timeout."""

import asyncio
from collections import Counter

import httpx
import pytest
from servers import STOP_TOKEN_IDS, RandomFaultUpstream, new_session

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

SESSIONS, TURNS = 64, 10
UPSTREAM_TIMEOUT_S = 2.0
CLIENT_TIMEOUT_S = 60.0  # a turn that takes longer counts as a hang (httpx raises, the test fails)


async def play(http: httpx.AsyncClient, url: str, index: int) -> tuple[list[str], list[httpx.Response]]:
    """One agent: a user message per turn; a failed turn's message is dropped (so the next turn extends only
    what was answered). Returns the user messages answered with 200, and the failed replies."""
    messages: list[dict] = []
    answered, failed = [], []
    for turn in range(TURNS):
        asked = f"session {index} turn {turn}"
        messages.append({"role": "user", "content": asked})
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
        reply = await http.post(f"{url}/v1/chat/completions", json={**body, "stop_token_ids": STOP_TOKEN_IDS})
        if reply.status_code == 200:
            messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
            answered.append(asked)
        else:
            messages.pop()
            failed.append(reply)
    return answered, failed


async def test_no_record_is_lost_and_every_failure_is_clean_under_random_upstream_faults(
    engine_url, start_session_server
):
    with RandomFaultUpstream(engine_url, seed=15, fault_rate=0.2, hang_s=UPSTREAM_TIMEOUT_S + 1) as upstream:
        server = start_session_server(upstream.url, upstream_timeout_s=UPSTREAM_TIMEOUT_S)
        session_ids = [new_session(server) for _ in range(SESSIONS)]
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, trust_env=False) as http:
            outcomes = await asyncio.gather(
                *(play(http, f"{server.url}/sessions/{sid}", i) for i, sid in enumerate(session_ids))
            )
            views = [(await http.get(f"{server.url}/sessions/{sid}")).json() for sid in session_ids]
    failures = [reply for _, failed in outcomes for reply in failed]
    assert set(upstream.injected) == set(RandomFaultUpstream.FAULTS), upstream.injected  # every kind was hit
    for (answered, _), view in zip(outcomes, views, strict=True):
        assert [record["request"]["messages"][-1]["content"] for record in view["records"]] == answered
    statuses = Counter(reply.status_code for reply in failures)
    assert all(400 <= code < 600 for code in statuses), statuses
    for reply in failures:
        assert reply.text.strip(), reply  # a body that says why: the server's {"error"} or the engine's own
        if reply.status_code == 502:
            assert reply.json()["error"]
    answered_turns = sum(len(answered) for answered, _ in outcomes)
    assert answered_turns + len(failures) == SESSIONS * TURNS
    print(
        f"\n{answered_turns} turns recorded, {len(failures)} clean failures {dict(statuses)}, "
        f"faults injected {dict(upstream.injected)}"
    )
