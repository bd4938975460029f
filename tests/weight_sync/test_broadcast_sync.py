"""BroadcastSync (disaggregated): this test process is the trainer, rank 0 of a gloo group with a real
embedded engine; adapter metadata goes over HTTP while the tensors are broadcast."""

from __future__ import annotations

import time

import pytest

from miles_runner.sglang_client.client import EngineClient, EngineError
from miles_runner.weight_sync.broadcast import BroadcastSync
from miles_runner.weight_sync.sync import make_sync

from .conftest import DIST_TIMEOUT_S
from .engine_probe import greedy_logprobs, is_paused, served_adapters, start_long_request

pytestmark = pytest.mark.integration

LORA = "broadcast_lora"


async def _cleanup(client: EngineClient, sync: BroadcastSync) -> None:
    await sync.close()
    if LORA in await served_adapters(client):
        await client.unload_lora_adapter(LORA)


@pytest.fixture()
async def sync(client, disaggregated_plan):
    broadcast_sync = BroadcastSync([client], disaggregated_plan, LORA, timeout_s=DIST_TIMEOUT_S)
    yield broadcast_sync
    await _cleanup(client, broadcast_sync)


@pytest.fixture()
async def upsert_sync(client, in_place_plan):
    broadcast_sync = BroadcastSync([client], in_place_plan, LORA, upsert=True, timeout_s=DIST_TIMEOUT_S)
    yield broadcast_sync
    await _cleanup(client, broadcast_sync)


async def _equals_from_disk(client: EngineClient, adapter) -> bool:
    await client.load_lora_adapter("from_disk", adapter.path)
    try:
        pushed, disk = await greedy_logprobs(client, LORA), await greedy_logprobs(client, "from_disk")
    finally:
        await client.unload_lora_adapter("from_disk")
    return pushed == pytest.approx(disk, abs=1e-5)


def test_the_disaggregated_plan_makes_a_broadcast_sync(disaggregated_plan):
    sync = make_sync(disaggregated_plan, [EngineClient("http://127.0.0.1:1")], LORA)
    assert type(sync) is BroadcastSync and sync.backend == "gloo"
    assert sync.master_address == "127.0.0.1", "one node: the store listens on loopback"
    # Engines on other nodes reach the trainer at node 0's own address (Deployment.trainer_address), where the
    # store then listens: loopback would be unreachable from them.
    across = make_sync(disaggregated_plan, [EngineClient("http://10.0.0.2:1")], LORA, trainer_address="10.0.0.1")
    assert across.master_address == "10.0.0.1"


async def test_pushed_adapter_generates_like_the_same_adapter_from_disk(client, sync, adapters):
    first, _ = adapters
    await sync.push(first.tensors, first.config, version=1)
    assert await _equals_from_disk(client, first)
    assert await greedy_logprobs(client, LORA) != pytest.approx(await greedy_logprobs(client, None), abs=1e-5)
    assert not await is_paused(client)


async def test_second_push_changes_the_output_and_bumps_the_weight_version(client, sync, adapters):
    first, second = adapters
    await sync.push(first.tensors, first.config, version=1)
    before = await greedy_logprobs(client, LORA)
    await sync.push(second.tensors, second.config, version=2)
    assert await greedy_logprobs(client, LORA) != pytest.approx(before, abs=1e-5)
    assert await _equals_from_disk(client, second)
    assert await client.weight_version() == "2"
    assert (await served_adapters(client)).count(LORA) == 1


async def test_upsert_replaces_the_adapter_in_place_under_requests_paused_in_place(client, upsert_sync, adapters):
    first, second = adapters
    await upsert_sync.push(first.tensors, first.config, version=1)
    running = await start_long_request(client, LORA)
    # An unload would wait for the paused request forever, and a flush would be refused while it holds its
    # KV cache: the push returns only because it does neither.
    await upsert_sync.push(second.tensors, second.config, version=2)
    assert not running.done()
    out = await running
    assert out["meta_info"]["finish_reason"]["type"] == "length" and out["meta_info"]["num_retractions"] == 0
    assert out["meta_info"]["weight_version"] == "2"
    assert await _equals_from_disk(client, second)


async def test_close_leaves_the_group_on_the_engine(client, sync, adapters):
    first, _ = adapters
    await sync.push(first.tensors, first.config, version=1)
    await sync.close()
    with pytest.raises(EngineError, match="is not initialized"):
        await client.destroy_weights_update_group(sync.group_name)


async def test_a_refused_push_fails_without_hanging_and_the_next_push_rebuilds_the_group(client, sync, adapters):
    first, second = adapters
    await client.load_lora_adapter(LORA, first.path)  # the sync did not load it, so it will not unload it
    started = time.monotonic()
    with pytest.raises(EngineError, match="already exists"):
        await sync.push(second.tensors, second.config, version=1)
    assert time.monotonic() - started < DIST_TIMEOUT_S + 10
    assert not await is_paused(client)
    await client.unload_lora_adapter(LORA)
    await sync.push(second.tensors, second.config, version=2)
    assert await _equals_from_disk(client, second)
