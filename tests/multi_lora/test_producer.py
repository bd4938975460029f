"""The producer: groups for every live adapter, stamped at submission, never posted for a gone adapter."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.cache import AdaptersCache, in_process
from miles_runner.multi_lora.collect import collect_batch
from miles_runner.multi_lora.controller import MultiLoRAController
from miles_runner.multi_lora.producer import GroupProducer
from miles_runner.sglang_client.engine_pool import fixed_engines

from .helpers import LIMITS, DeterministicGenerator, defaults, eventually


@dataclass
class Rollout:
    controller: MultiLoRAController
    buffers: AdapterBuffers
    generator: DeterministicGenerator
    producer: GroupProducer


def prompt_number(run, index: int) -> int:
    return 100 * run.slot + index


@contextlib.asynccontextmanager
async def rollout(
    tmp_path: Path,
    *active: str,
    backlog: int | None = None,
    generate=None,
    hold: str | None = None,
    abort_all: bool = False,
):
    """A producer over a live controller. `hold` ("before_post"/"after_post") starts with requests held there."""
    controller = MultiLoRAController(defaults(str(tmp_path)), replace(LIMITS, max_slots=4), fixed_engines([]))
    for name in active:
        controller.register_adapter(name, {})
    controller.record_weight_update(active)
    cache = AdaptersCache(in_process(controller.snapshot), ttl_s=0.0)
    buffers = AdapterBuffers(dp_size=1, max_staleness=None)
    generator = DeterministicGenerator(cache, abort_all=abort_all)
    if hold:
        getattr(generator, hold).clear()
    producer = GroupProducer(
        cache, buffers, prompt_number, generate or generator, concurrency=4, max_backlog_groups=backlog
    )
    producer.start()
    try:
        yield Rollout(controller, buffers, generator, producer)
    finally:
        await producer.stop()


@pytest.fixture
async def two(tmp_path) -> AsyncIterator[Rollout]:
    async with rollout(tmp_path, "a", "b") as running:
        yield running


async def test_the_producer_feeds_every_live_adapter_and_no_pending_one(tmp_path):
    async with rollout(tmp_path, "a", "b") as running:
        running.controller.register_adapter("p", {})  # PENDING: its weights are not on the engines yet
        await eventually(lambda: running.buffers.buffered("a") >= 2 and running.buffers.buffered("b") >= 2)
        assert running.buffers.buffered("p") == 0
        assert not any(fields["rid"].startswith("p::") for fields in running.generator.posted)


async def test_the_backlog_per_adapter_is_bounded(tmp_path):
    async with rollout(tmp_path, "a", backlog=3) as running:
        await eventually(lambda: running.buffers.buffered("a") == 3)
        await eventually(lambda: len(running.producer._tasks) == 0)
        assert running.buffers.buffered("a") == 3


async def test_requests_carry_the_slot_a_prefixed_rid_and_the_version_key(two):
    await eventually(lambda: len(two.generator.posted) >= 4)
    fields = next(f for f in two.generator.posted if f["rid"].startswith("b::"))
    assert fields["lora_path"] == "__miles_slot_1" and fields["extra_key"] == "b:v1"
    assert len(fields["rid"]) == len("b::") + 32


async def test_groups_are_stamped_with_the_submission_version_and_registration(tmp_path):
    async with rollout(tmp_path, "a", "b", hold="after_post") as two:
        await eventually(lambda: len(two.producer._tasks) == 4)
        registration = two.controller.snapshot().active["a"].registration_id
        two.controller.record_weight_update(["a"])  # version 2 lands while the first groups are in flight
        two.generator.after_post.set()
        await eventually(lambda: two.buffers.buffered("a") >= 1)
        first = two.buffers.buffers["a"].get(1)[0]
    assert (first.slot_version, first.registration_id) == (1, registration)
    stamps = {"adapter": "a", "slot": 0, "slot_version": 1, "registration_id": registration}
    assert first.samples[0].metadata == stamps


async def test_no_request_is_posted_for_an_adapter_no_longer_sampleable(tmp_path):
    async with rollout(tmp_path, "a", "b", hold="before_post") as two:
        await eventually(lambda: len(two.producer._tasks) == 4)
        two.controller.deregister_adapter("a")
        await two.controller.retire_adapters()  # CLEANUP: no longer sampleable
        two.generator.before_post.set()
        await eventually(lambda: two.buffers.dropped["a", "aborted"] == 2)
        assert not any(fields["rid"].startswith("a::") for fields in two.generator.posted)
        assert two.buffers.buffered("a") == 0


async def test_an_aborted_sample_drops_the_whole_group(tmp_path):
    async with rollout(tmp_path, "a", abort_all=True) as running:
        await eventually(lambda: running.buffers.dropped["a", "aborted"] >= 2)
        assert running.buffers.buffered("a") == 0


async def test_a_straggler_of_a_previous_registration_is_dropped(tmp_path):
    async with rollout(tmp_path, "a", "b", hold="after_post") as two:
        await eventually(lambda: len(two.producer._tasks) == 4)  # two groups of "a" posted, answers held
        two.controller.deregister_adapter("a")
        await two.controller.retire_adapters()
        await two.controller.free_slot("a")
        two.controller.register_adapter("a", {})
        two.controller.record_weight_update(["a"])
        two.generator.after_post.set()
        await eventually(lambda: two.buffers.dropped["a", "straggler"] == 2)
        fresh = two.controller.snapshot().active["a"].registration_id
        await eventually(lambda: two.buffers.buffered("a") >= 1)
        assert {g.registration_id for g in two.buffers.buffers["a"].get(100)} == {fresh}


async def test_a_failing_generate_kills_the_producer_and_collect_raises_its_cause(tmp_path):
    async def failing_generate(run, prompt):
        raise ConnectionError("engine unreachable")

    async with rollout(tmp_path, "a", generate=failing_generate) as running:
        await eventually(lambda: running.buffers.failure is not None)
        with pytest.raises(RuntimeError) as caught:
            await collect_batch(
                running.buffers, running.controller.snapshot(), target_samples=8, coalesce_wait_s=0.1, empty_wait_s=1
            )
        assert isinstance(caught.value.__cause__, ConnectionError)


async def test_collect_gets_a_full_batch_from_the_running_producer(two):
    batch = await collect_batch(
        two.buffers, two.controller.snapshot(), target_samples=16, coalesce_wait_s=1.0, empty_wait_s=5.0
    )
    assert batch.group_counts == {"a": 4, "b": 4} and batch.step_names == ["a", "b"]
