"""Choosing the worker of a prompt group or session (sglang_client/engine_pool.py): least-loaded, ties in turn, one
worker per key while it lives. The workers here are never called: pinning only names them."""

from __future__ import annotations

import asyncio

import pytest

from miles_runner.sglang_client.client import EngineUnavailable
from miles_runner.sglang_client.engine_pool import EnginePool, fixed_engines

A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def pool(*urls: str) -> EnginePool:
    return EnginePool(fixed_engines(urls), where="the test engines")


async def test_keys_in_flight_together_spread_evenly_over_the_workers():
    workers = pool(A, B)
    clients = [await workers.pin(f"group-{i}") for i in range(4)]
    assert sorted(client.base_url for client in clients) == [A, A, B, B]
    await workers.aclose()


async def test_keys_pinned_one_at_a_time_alternate_over_the_workers():
    workers = pool(A, B)
    served = []
    for i in range(4):
        async with workers.lease(f"group-{i}") as client:
            served.append(client.base_url)
    assert served == [A, B, A, B]
    await workers.aclose()


async def test_a_new_key_goes_to_the_worker_with_the_fewest_live_pins():
    workers = pool(A, B)
    await workers.pin("a1"), await workers.pin("b1"), await workers.pin("a2")  # A: a1, a2; B: b1
    workers.release("b1")
    assert (await workers.pin("next")).base_url == B
    await workers.aclose()


async def test_every_call_for_one_key_gets_its_one_worker_until_released():
    workers = pool(A, B)
    first = await asyncio.gather(*(workers.pin("session") for _ in range(5)))
    assert {client.base_url for client in first} == {workers.pinned("session")}
    workers.release("session")
    assert workers.pinned("session") is None
    await workers.aclose()


async def test_no_worker_is_unavailable_and_names_where_they_were_looked_for():
    with pytest.raises(EngineUnavailable, match="the test engines lists no healthy worker"):
        await pool().pin("group")
