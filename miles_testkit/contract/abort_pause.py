"""Aborts (by rid, all, by prefix) and the three pause modes: what happens to running and new requests."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from miles_runner.core.sglang_protocol import MILES_FORK
from miles_runner.sglang_client import response as res
from miles_testkit.contract.base import ContractTarget, contract_check
from miles_testkit.contract.helpers import (
    BackgroundStream,
    expect,
    generate_payload,
    long_stream,
    rid,
    still_running_after,
)


@contract_check
async def abort_by_rid_returns_partial_tokens(target: ContractTarget) -> dict[str, Any]:
    async with long_stream(target, "abort") as stream:
        await stream.wait_started()
        await target.client.abort_request(stream.rid)
        final = await stream.result()
    expect(res.is_aborted(final), f"finish_reason {final['meta_info']['finish_reason']}, expected abort")
    tokens = len(final["output_ids"])
    expect(0 < tokens < target.long_tokens, f"expected partial tokens, got {tokens}")
    expect(len(res.output_token_logprobs(final)[0]) == tokens, "logprobs not aligned with partial tokens")
    return {"partial_tokens": tokens}


@contract_check
async def abort_all_aborts_non_streaming_requests(target: ContractTarget) -> dict[str, Any]:
    request = generate_payload(target.long_tokens, rid=rid("abort-all"))
    pending = asyncio.create_task(target.client.generate(request))
    async with long_stream(target, "abort-all-stream") as stream:
        await stream.wait_started()
        await target.client.abort_request(abort_all=True)
        streamed = await stream.result()
    result = await asyncio.wait_for(pending, 60)
    expect(res.is_aborted(result) and res.is_aborted(streamed), "abort_all left a request unaborted")
    return {"partial_tokens": len(result["output_ids"])}


@contract_check
async def abort_by_prefix_aborts_every_match(target: ContractTarget) -> dict[str, Any]:
    """A fork-only field (core.sglang_protocol): stock SGLang drops `prefix`, so nothing matches the bare prefix."""
    if target.build != MILES_FORK:
        return await _stock_drops_the_prefix(target)
    prefix = rid("prefix") + "-"
    async with contextlib.AsyncExitStack() as running:
        streams = [
            await running.enter_async_context(
                BackgroundStream(target.client, generate_payload(target.long_tokens, rid=f"{prefix}{i}"))
            )
            for i in range(2)
        ]
        bystander = asyncio.create_task(target.client.generate(generate_payload(16, rid=rid("bystander"))))
        for stream in streams:
            await stream.wait_started()
        await target.client.abort_request(prefix, prefix=True)
        finals = [await stream.result() for stream in streams]
    expect(all(res.is_aborted(final) for final in finals), "a request matching the prefix was not aborted")
    expect(res.finish_reason_type(await bystander) == "length", "a request outside the prefix was aborted")
    return {}


async def _stock_drops_the_prefix(target: ContractTarget) -> dict[str, Any]:
    prefix = rid("prefix") + "-"
    async with BackgroundStream(target.client, generate_payload(16, rid=f"{prefix}0")) as stream:
        await stream.wait_started()
        await target.client.abort_request(prefix, prefix=True)
        final = await stream.result()
    expect(res.finish_reason_type(final) == "length", "a stock engine aborted by prefix, which it does not serve")
    return {"prefix": "dropped (stock)"}


@contract_check
async def pause_abort_aborts_running_and_holds_new_requests(target: ContractTarget) -> dict[str, Any]:
    async with long_stream(target, "pause-abort") as stream:
        await stream.wait_started()
        try:
            await target.client.pause_generation("abort")
            final = await stream.result()
            expect(res.is_aborted(final), "pause(abort) did not abort the running request")
            held = asyncio.create_task(target.client.generate(generate_payload(4)))
            await asyncio.sleep(1.0)
            expect(not held.done(), "a request sent while paused was not held")
        finally:
            await target.client.continue_generation()
    result = await asyncio.wait_for(held, 60)
    expect(res.finish_reason_type(result) == "length", "the held request did not complete after continue")
    return {}


async def _pause_then_resume(target: ContractTarget, mode: str) -> dict[str, Any]:
    """A running request survives `mode` (retract or in_place): no tokens while paused, complete after."""
    async with long_stream(target, f"pause-{mode}", max_new_tokens=target.long_tokens) as stream:
        await stream.wait_started()
        try:
            await target.client.pause_generation(mode)
            paused_at = stream.tokens_so_far
            expect(await still_running_after(stream, 1.0), f"the request finished during pause({mode})")
            expect(stream.tokens_so_far <= paused_at + 1, f"tokens kept flowing during pause({mode})")
            flushed = await target.client.flush_cache()
        finally:
            await target.client.continue_generation()
        final = await stream.result()
    expect(res.finish_reason_type(final) == "length", f"finish {final['meta_info']['finish_reason']}")
    expect(len(final["output_ids"]) == target.long_tokens, "the resumed request is incomplete")
    return {"flush_cache_while_paused": flushed, "tokens_at_pause": paused_at}


@contract_check
async def pause_retract_resumes_running_requests(target: ContractTarget) -> dict[str, Any]:
    return await _pause_then_resume(target, "retract")


@contract_check
async def pause_in_place_resumes_running_requests_and_blocks_flush(target: ContractTarget) -> dict[str, Any]:
    facts = await _pause_then_resume(target, "in_place")
    expect(facts["flush_cache_while_paused"] is False, "flush_cache succeeded with a request kept in place")
    return facts
