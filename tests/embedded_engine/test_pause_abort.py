"""Abort (exact rid, prefix, all) and pause modes abort / in_place / retract, with SGLang's meaning."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.integration

PROMPT_IDS = [5, 6, 7, 8]
LONG = {"max_new_tokens": 1500, "temperature": 0.0, "ignore_eos": True}
ADMIT_TIMEOUT_S = 60.0


async def until_running(client) -> None:
    """Wait until the engine has admitted a request into its running batch: a fixed sleep is not enough on a
    loaded machine, where a pause could land before the request runs (and so find nothing to retract)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + ADMIT_TIMEOUT_S
    while not (await client.get("/server_info")).json()["internal_states"][0]["num_running_reqs"]:
        assert loop.time() < deadline, f"no request was admitted within {ADMIT_TIMEOUT_S} s"
        await asyncio.sleep(0.01)


async def post_generate(client, **body) -> dict:
    response = await client.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": LONG, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_abort_returns_the_partial_tokens_with_an_abort_finish(client):
    task = asyncio.create_task(post_generate(client, rid="abort-me", return_logprob=True))
    await until_running(client)
    response = await client.post("/abort_request", json={"rid": "abort-me"})
    assert response.status_code == 200 and response.content == b""
    out = await task
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < LONG["max_new_tokens"]
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])


async def test_abort_with_prefix_aborts_every_matching_rid_only(client):
    session = [asyncio.create_task(post_generate(client, rid=f"sess7:{turn}")) for turn in range(2)]
    other = asyncio.create_task(post_generate(client, rid="other-1", sampling_params={**LONG, "max_new_tokens": 60}))
    await until_running(client)
    await client.post("/abort_request", json={"rid": "sess7:", "prefix": True})
    assert [out["meta_info"]["finish_reason"]["type"] for out in await asyncio.gather(*session)] == ["abort"] * 2
    assert (await other)["meta_info"]["finish_reason"]["type"] == "length"


async def test_abort_all_aborts_everything(client):
    tasks = [asyncio.create_task(post_generate(client)) for _ in range(3)]
    await until_running(client)
    await client.post("/abort_request", json={"abort_all": True})
    assert [out["meta_info"]["finish_reason"]["type"] for out in await asyncio.gather(*tasks)] == ["abort"] * 3


async def test_abort_of_an_unknown_rid_is_a_200_no_op(client):
    response = await client.post("/abort_request", json={"rid": "no-such-request"})
    assert response.status_code == 200


async def test_pause_abort_mode_aborts_in_flight_and_holds_new_requests(client):
    running = asyncio.create_task(post_generate(client))
    await until_running(client)
    reply = await client.post("/pause_generation", json={"mode": "abort"})
    assert reply.json() == {"message": "Generation paused successfully.", "status": "ok"}
    try:
        assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"
        held = asyncio.create_task(post_generate(client, sampling_params={**LONG, "max_new_tokens": 4}))
        await asyncio.sleep(0.5)
        assert not held.done()
    finally:
        await client.post("/continue_generation", json={})
    assert (await held)["meta_info"]["finish_reason"]["type"] == "length"


async def _stream_events(client, body: dict, events: list[dict]) -> None:
    async with client.stream("POST", "/generate", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: ") :]))


async def test_pause_in_place_freezes_requests_and_continue_resumes_them(client):
    events: list[dict] = []
    body = {"input_ids": PROMPT_IDS, "sampling_params": {**LONG, "max_new_tokens": 400}}
    stream = asyncio.create_task(_stream_events(client, body, events))
    await until_running(client)
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        frozen_at = len(events)
        await asyncio.sleep(0.5)
        assert len(events) <= frozen_at + 1  # at most the step that was running when the pause landed
        flush = await client.post("/flush_cache")
        assert flush.status_code == 400  # requests keep their KV cache while paused in place
    finally:
        await client.post("/continue_generation", json={})
    await stream
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "length" and final["num_retractions"] == 0


async def test_pause_retract_requeues_and_the_request_finishes_identically(client):
    params = {**LONG, "max_new_tokens": 300}
    reference = await post_generate(client, sampling_params=params)
    task = asyncio.create_task(post_generate(client, sampling_params=params))
    await until_running(client)
    await client.post("/pause_generation", json={"mode": "retract"})
    try:
        assert (await client.post("/flush_cache")).status_code == 200  # no KV is held after a retract
    finally:
        await client.post("/continue_generation", json={})
    out = await task
    assert out["meta_info"]["num_retractions"] >= 1
    assert out["output_ids"] == reference["output_ids"]


async def test_flush_cache_succeeds_when_idle(client):
    response = await client.post("/flush_cache")
    assert response.status_code == 200 and response.text.startswith("Cache flushed")


async def test_flush_cache_is_400_while_requests_run(client):
    task = asyncio.create_task(post_generate(client, rid="flush-busy"))
    await until_running(client)
    try:
        assert (await client.post("/flush_cache")).status_code == 400
    finally:
        await client.post("/abort_request", json={"rid": "flush-busy"})
        await task


async def test_health_answers_while_a_batch_is_generating(client):
    task = asyncio.create_task(post_generate(client, rid="busy-health"))
    await until_running(client)
    try:
        response = await client.get("/health", timeout=1.0)
        assert response.status_code == 200
        assert (await client.get("/health_generate", timeout=10.0)).status_code == 200
    finally:
        await client.post("/abort_request", json={"rid": "busy-health"})
        await task


async def test_a_prefix_abort_reaches_requests_held_at_the_pause_gate(client):
    """A retired adapter's request that arrived while the engine was paused for a weight push must not run
    once generation continues (the controller aborts the adapter's `name::` prefix during the push)."""
    await client.post("/pause_generation", json={"mode": "in_place"})
    try:
        held = asyncio.create_task(post_generate(client, rid="victim::held", sampling_params=LONG))
        short = {**LONG, "max_new_tokens": 4}
        other = asyncio.create_task(post_generate(client, rid="other::held", sampling_params=short))
        await asyncio.sleep(0.5)
        await client.post("/abort_request", json={"rid": "victim::", "prefix": True})
    finally:
        await client.post("/continue_generation", json={})
    answer = await held
    assert answer["meta_info"]["finish_reason"]["type"] == "abort"
    assert answer["meta_info"]["completion_tokens"] == 0
    assert (await other)["meta_info"]["finish_reason"]["type"] == "length"  # other adapters' requests run
