"""Many sessions at once: one lock per session, never held across the engine call."""

import asyncio
import time

import httpx
import pytest
from servers import STOP_TOKEN_IDS, get_session, new_session

SESSIONS = 64
TURNS = 10


async def play(http: httpx.AsyncClient, url: str, index: int) -> None:
    messages: list[dict] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"session {index} turn {turn}"})
        body = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
        reply = await http.post(f"{url}/v1/chat/completions", json={**body, "stop_token_ids": STOP_TOKEN_IDS})
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})


@pytest.mark.slow
async def test_64_concurrent_sessions_of_10_turns_lose_and_misorder_no_record(lora_server):
    session_ids = [new_session(lora_server) for _ in range(SESSIONS)]
    async with httpx.AsyncClient(timeout=300, trust_env=False) as http:
        await asyncio.gather(
            *(play(http, f"{lora_server.url}/sessions/{sid}", index) for index, sid in enumerate(session_ids))
        )
    for index, session_id in enumerate(session_ids):
        records = get_session(lora_server, session_id)["records"]
        asked = [record["request"]["messages"][-1]["content"] for record in records]
        assert asked == [f"session {index} turn {turn}" for turn in range(TURNS)]


async def test_a_slow_turn_does_not_block_other_sessions_or_reads(lora_server):
    slow_session, fast_session = new_session(lora_server), new_session(lora_server)
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
        slow = asyncio.create_task(
            http.post(
                f"{lora_server.url}/sessions/{slow_session}/v1/chat/completions",
                json={**body, "max_tokens": 200, "stop_token_ids": []},
            )
        )
        await asyncio.sleep(0.3)
        started = time.monotonic()
        read = await http.get(f"{lora_server.url}/sessions/{slow_session}")
        fast = await http.post(
            f"{lora_server.url}/sessions/{fast_session}/v1/chat/completions",
            json={**body, "max_tokens": 1},
        )
        fast_done = time.monotonic() - started
        assert read.status_code == 200 and fast.status_code == 200
        assert not slow.done(), f"the slow turn finished before the fast one ({fast_done:.2f} s)"
        assert (await slow).status_code == 200
