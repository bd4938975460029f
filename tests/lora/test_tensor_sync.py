"""TensorSync (colocated): pause, flush, unload-then-load from tensors in the request, version, continue."""

from __future__ import annotations

import pytest

from miles_runner.engine.client import EngineClient
from miles_runner.lora.sync import make_sync
from miles_runner.lora.tensor_sync import TensorSync

from .engine_probe import greedy_logprobs, is_paused, served_adapters, start_long_request


@pytest.fixture()
async def sync(client, colocated_plan):
    tensor_sync = TensorSync([client], colocated_plan, "tensor_lora")
    yield tensor_sync
    if "tensor_lora" in await served_adapters(client):
        await client.unload_lora_adapter("tensor_lora")


def test_the_colocated_plan_makes_a_tensor_sync(colocated_plan):
    assert type(make_sync(colocated_plan, [EngineClient("http://127.0.0.1:1")], "x")) is TensorSync


async def test_push_serves_the_adapter_bumps_the_version_and_leaves_the_engine_running(client, sync, adapters):
    first, _ = adapters
    report = await sync.push(first.tensors, first.config, version=3)
    assert report.version == 3 and report.engines == 1 and report.bytes > 0
    assert "tensor_lora" in await served_adapters(client)
    assert await client.weight_version() == "3"
    assert not await is_paused(client)
    await client.load_lora_adapter("disk_first", first.path)
    try:
        assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
            await greedy_logprobs(client, "disk_first"), abs=1e-5
        )
    finally:
        await client.unload_lora_adapter("disk_first")


async def test_push_pauses_running_requests_and_continues_them(client, sync, adapters):
    first, second = adapters
    await sync.push(first.tensors, first.config, version=1)
    running = await start_long_request(client, None)  # base model: the adapter's unload must not wait for it
    await sync.push(second.tensors, second.config, version=2)
    out = await running
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["num_retractions"] >= 1  # the plan's pause mode, retract, took it off and back on
    assert not await is_paused(client)


async def test_second_push_unloads_and_reloads_with_the_new_tensors(client, sync, adapters):
    first, second = adapters
    await sync.push(first.tensors, first.config, version=1)
    before = await greedy_logprobs(client, "tensor_lora")
    await sync.push(second.tensors, second.config, version=2)
    assert (await served_adapters(client)).count("tensor_lora") == 1
    await client.load_lora_adapter("disk_second", second.path)
    try:
        after = await greedy_logprobs(client, "tensor_lora")
        assert after != pytest.approx(before, abs=1e-5)
        assert after == pytest.approx(await greedy_logprobs(client, "disk_second"), abs=1e-5)
    finally:
        await client.unload_lora_adapter("disk_second")
    assert await client.weight_version() == "2"
