"""The prefix cache (SGLang's radix cache): a request that starts with a finished request's tokens prefills only the
rest, says so in `meta_info.cached_tokens`, and answers as it would have without the cache: the same tokens, the
same logprobs up to float rounding, the same routed experts. Namespaces (extra_key, adapter, weights) never mix,
/flush_cache empties it, and --disable-radix-cache turns it off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from miles_runner.embedded_engine import prefix_cache as prefix_cache_module
from miles_runner.embedded_engine.prefix_cache import BLOCK, PrefixCache
from miles_runner.sglang_client.routed_experts import decode_routed_experts

from .server_process import EngineProcess, start_engine

PROMPT = [(7 * i) % 300 + 5 for i in range(40)]  # 40 tokens of the tiny vocabulary
GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


# ----- the cache alone ----------------------------------------------------------------------------------------
def kv_of(length: int, fill: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((2, length, 4), fill), torch.full((2, length, 4), -fill)) for _ in range(2)]


def test_a_match_is_the_longest_shared_prefix_token_by_token_within_the_limit():
    cache = PrefixCache()
    tokens = list(range(50))
    cache.insert("ns", tokens, kv_of(50), None)
    asked = [*tokens[:37], 999, 1000]
    assert cache.match("ns", asked, limit=len(asked) - 1)[0] == 37  # past the last whole block (32)
    assert cache.match("ns", asked, limit=20)[0] == 20
    assert cache.match("ns", tokens[:10], limit=9) == (0, None)  # less than a block is never matched
    assert cache.match("other", asked, limit=38) == (0, None)
    length, entry = cache.match("ns", asked, limit=38)
    kv, routing = entry.head(length)
    assert kv[0][0].shape == (2, 37, 4) and routing is None


def test_a_hash_collision_is_no_match(monkeypatch):
    cache = PrefixCache()
    cache.insert("ns", list(range(32)), kv_of(32), None)
    monkeypatch.setattr(prefix_cache_module, "_block_hashes", lambda tokens: [1] * (len(tokens) // BLOCK))
    cache.insert("ns", list(range(32)), kv_of(32), None)  # indexed under the colliding hashes
    assert cache.match("ns", list(range(100, 140)), limit=39) == (0, None)


def test_the_least_recently_used_prefixes_go_first():
    one = sum(t.nbytes for pair in kv_of(32) for t in pair)
    cache = PrefixCache(budget_bytes=2 * one)
    a, b, c = list(range(32)), list(range(100, 132)), list(range(200, 232))
    cache.insert("ns", a, kv_of(32), None)
    cache.insert("ns", b, kv_of(32), None)
    cache.match("ns", [*a, 1], limit=32)  # a is used: b is now the least recent
    cache.insert("ns", c, kv_of(32), None)
    assert len(cache) == 2 and cache.nbytes == 2 * one
    assert cache.match("ns", [*b, 1], limit=32) == (0, None) and cache.match("ns", [*a, 1], limit=32)[0] == 32


def test_a_continued_prefix_replaces_the_one_it_started_from():
    cache = PrefixCache()
    start = list(range(32))
    cache.insert("ns", start, kv_of(32), None)
    _, entry = cache.match("ns", [*start, 1], limit=32)
    cache.insert("ns", start + list(range(16)), kv_of(48), None, replaces=entry)
    length, now = cache.match("ns", [*start, 1], limit=32)
    assert len(cache) == 1 and length == 32 and now is not entry and len(now.tokens) == 48


def test_routing_rows_are_kept_with_their_tokens():
    cache = PrefixCache()
    routing = np.arange(40 * 2 * 2, dtype=np.int32).reshape(40, 2, 2)
    cache.insert("ns", list(range(40)), kv_of(40), routing)
    length, entry = cache.match("ns", [*list(range(35)), 7], limit=35)
    assert length == 35 and np.array_equal(entry.head(length)[1], routing[:35])


# ----- the engine -------------------------------------------------------------------------------------------------
async def generate(client: httpx.AsyncClient, input_ids: list[int], **body) -> dict:
    reply = await client.post("/generate", json={"input_ids": input_ids, "sampling_params": GREEDY, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


async def flush(client: httpx.AsyncClient) -> None:
    reply = await client.post("/flush_cache")
    assert reply.status_code == 200, reply.text


async def test_a_continued_conversation_comes_from_the_cache_and_answers_as_without_it(client):
    await flush(client)
    first = await generate(client, PROMPT)
    assert first["meta_info"]["cached_tokens"] == 0
    turn = PROMPT + first["output_ids"] + [11, 12, 13, 14, 15, 16]
    asked = {"return_logprob": True, "return_routed_experts": True}
    cached = await generate(client, turn, **asked)
    # The first request's KV covers every token that went through a forward: all but its last sampled one.
    assert cached["meta_info"]["cached_tokens"] == len(PROMPT) + len(first["output_ids"]) - 1
    await flush(client)
    fresh = await generate(client, turn, **asked)
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == fresh["output_ids"]
    logprobs = [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in (cached, fresh)]
    assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-4)
    rows = len(turn) + len(fresh["output_ids"]) - 1
    routed = [decode_routed_experts(r["meta_info"]["routed_experts"], rows, 2) for r in (cached, fresh)]
    assert routed[0].shape[0] == rows and np.array_equal(routed[0], routed[1])


async def test_prompt_logprobs_asked_from_a_position_are_computed_from_there(client):
    await flush(client)
    await generate(client, PROMPT)
    asked = {"return_logprob": True, "logprob_start_len": 20}
    cached = await generate(client, [*PROMPT, 9, 9, 9], **asked)
    assert cached["meta_info"]["cached_tokens"] == 20  # SGLang: no further than the first asked position
    await flush(client)
    fresh = await generate(client, [*PROMPT, 9, 9, 9], **asked)
    entries = [r["meta_info"]["input_token_logprobs"] for r in (cached, fresh)]
    assert [e[1] for e in entries[0]] == [e[1] for e in entries[1]] == ([*PROMPT, 9, 9, 9])[20:]
    assert entries[0][0][0] is None and entries[1][0][0] is None
    assert [e[0] for e in entries[0][1:]] == pytest.approx([e[0] for e in entries[1][1:]], abs=1e-4)


async def test_an_extra_key_or_an_adapter_is_a_namespace_of_its_own(client):
    await flush(client)
    await generate(client, PROMPT, extra_key="tenant-a")
    assert (await generate(client, PROMPT, extra_key="tenant-b"))["meta_info"]["cached_tokens"] == 0
    assert (await generate(client, PROMPT))["meta_info"]["cached_tokens"] == 0
    assert (await generate(client, PROMPT, lora_path="attn_a"))["meta_info"]["cached_tokens"] == 0
    assert (await generate(client, PROMPT, extra_key="tenant-a"))["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    assert (await generate(client, PROMPT, lora_path="attn_a"))["meta_info"]["cached_tokens"] == len(PROMPT) - 1


async def test_an_adapter_loaded_again_never_reuses_the_old_weights_kv(client, adapter_dirs):
    await flush(client)
    load = {"lora_name": "prefix_reload", "lora_path": str(adapter_dirs["attn_b"])}
    assert (await client.post("/load_lora_adapter", json=load)).status_code == 200
    try:
        await generate(client, PROMPT, lora_path="prefix_reload")
        assert (await generate(client, PROMPT, lora_path="prefix_reload"))["meta_info"]["cached_tokens"] > 0
        assert (await client.post("/unload_lora_adapter", json={"lora_name": "prefix_reload"})).status_code == 200
        assert (await client.post("/load_lora_adapter", json=load)).status_code == 200
        assert (await generate(client, PROMPT, lora_path="prefix_reload"))["meta_info"]["cached_tokens"] == 0
    finally:
        await client.post("/unload_lora_adapter", json={"lora_name": "prefix_reload"})


async def test_flush_cache_empties_it(client):
    await generate(client, PROMPT)
    await flush(client)
    assert (await generate(client, PROMPT))["meta_info"]["cached_tokens"] == 0


@pytest.fixture(scope="module")
def uncached_engine(tiny_moe_dir: Path, tmp_path_factory) -> Iterator[EngineProcess]:
    process = start_engine(tiny_moe_dir, tmp_path_factory.mktemp("uncached") / "engine.log", "--disable-radix-cache")
    yield process
    process.stop()


@pytest.mark.integration
async def test_disable_radix_cache_prefills_every_prompt_whole(uncached_engine):
    async with httpx.AsyncClient(base_url=uncached_engine.url, timeout=60.0) as http:
        first = await generate(http, PROMPT)
        again = await generate(http, PROMPT + first["output_ids"])
    assert first["meta_info"]["cached_tokens"] == again["meta_info"]["cached_tokens"] == 0
    assert again["output_ids"]  # it still answers
