"""TensorSync (colocated): pause, flush, unload-then-load from tensors in the request, version, continue."""

from __future__ import annotations

import pytest
import torch

from miles_runner.sglang_client import tensor_shm
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.tensor_shm import TensorSegment
from miles_runner.weight_sync.sync import make_sync
from miles_runner.weight_sync.tensor_sync import TensorSync

from .engine_probe import disk_logprobs, greedy_logprobs, is_paused, served_adapters, start_long_request


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
    assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
        await disk_logprobs(client, first.path), abs=1e-5
    )


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
    after = await greedy_logprobs(client, "tensor_lora")
    assert after != pytest.approx(before, abs=1e-5)
    assert after == pytest.approx(await disk_logprobs(client, second.path), abs=1e-5)
    assert await client.weight_version() == "2"


class VanishingSegment(TensorSegment):
    """Fault injection: the segment is removed as soon as it is written, as an engine with another /dev/shm (a
    container of its own) would find it: not there."""

    def write(self, named_tensors):
        handle = super().write(named_tensors)
        self.path.unlink()
        return handle


needs_shm = pytest.mark.skipif(not tensor_shm.shared_memory_available(), reason="no /dev/shm on this host")


@needs_shm
async def test_an_engine_on_this_host_gets_a_handle_and_close_removes_the_segment(client, sync, adapters):
    first, _ = adapters
    await sync.push(first.tensors, first.config, version=1)
    assert sync._by_handle == {client.base_url} and sync._segment.path.exists()
    path = sync._segment.path
    await sync.close()
    assert not path.exists()


@needs_shm
async def test_the_engines_adapter_is_its_own_copy_not_the_segment(client, colocated_plan, adapters):
    first, second = adapters
    fresh = TensorSync([client], colocated_plan, "never_loaded_lora")  # a first load: built, not parked
    await fresh.push(first.tensors, first.config, version=1)
    fresh._segment.write(second.tensors.items())  # the next push's bytes, written before any unload
    try:
        assert await greedy_logprobs(client, "never_loaded_lora") == pytest.approx(
            await disk_logprobs(client, first.path), abs=1e-5
        )
    finally:
        await client.unload_lora_adapter("never_loaded_lora")
        await fresh.close()


@needs_shm
async def test_an_engine_that_cannot_open_the_segment_gets_the_tensors_inline_from_then_on(client, sync, adapters):
    first, second = adapters
    sync._segment = VanishingSegment()
    await sync.push(first.tensors, first.config, version=1)
    assert client.base_url not in sync._by_handle
    await sync.push(second.tensors, second.config, version=2)  # inline, without asking the engine again
    try:
        assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
            await disk_logprobs(client, second.path), abs=1e-5
        )
    finally:
        await sync.close()


async def test_without_shared_memory_every_engine_gets_the_tensors_inline(client, colocated_plan, adapters):
    first, _ = adapters
    inline = TensorSync([client], colocated_plan, "inline_lora", shared_memory=False)
    await inline.push(first.tensors, first.config, version=1)
    try:
        assert not inline._by_handle and inline._segment is None
        assert "inline_lora" in await served_adapters(client)
    finally:
        await client.unload_lora_adapter("inline_lora")


@needs_shm
async def test_shared_tensors_are_pushed_by_handle_with_no_copy_and_what_changes_in_them_is_served(
    client, sync, adapters
):
    first, second = adapters
    homes = sync.share(first.tensors)
    assert homes is not None and all(homes[k].data_ptr() != first.tensors[k].data_ptr() for k in homes)
    assert (await sync.push(homes, first.config, version=1)).shared_memory
    assert sync._segment is None  # nothing was copied into a hand-off segment
    assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
        await disk_logprobs(client, first.path), abs=1e-5
    )
    for name, home in homes.items():  # the trainer's optimizer step, in place
        home.copy_(second.tensors[name])
    await sync.push(homes, second.config, version=2)
    assert sync._segment is None
    assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
        await disk_logprobs(client, second.path), abs=1e-5
    )
    await sync.close()


@needs_shm
async def test_other_tensors_pushed_after_sharing_never_overwrite_the_shared_ones(client, sync, adapters):
    first, second = adapters
    homes = sync.share(second.tensors)
    report = await sync.push(first.tensors, first.config, version=1)  # e.g. the frozen initial adapter: a copy
    assert sync._segment is not None and not report.shared_memory
    assert all(torch.equal(homes[k], second.tensors[k]) for k in homes)
    assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
        await disk_logprobs(client, first.path), abs=1e-5
    )
    await sync.reset()  # restarted engines: the shared tensors stay shared
    await client.unload_lora_adapter("tensor_lora")  # as a restarted engine comes back: without it
    await sync.push(homes, second.config, version=2)
    assert await greedy_logprobs(client, "tensor_lora") == pytest.approx(
        await disk_logprobs(client, second.path), abs=1e-5
    )
    path = sync._shared._segment.path
    await sync.close()
    assert not path.exists() and all(torch.equal(homes[k], second.tensors[k]) for k in homes)


async def test_nothing_is_shared_where_no_engine_reads_shared_memory(client, colocated_plan, adapters):
    first, _ = adapters
    inline = TensorSync([client], colocated_plan, "inline_lora", shared_memory=False)
    assert inline.share(first.tensors) is None
    await inline.close()
