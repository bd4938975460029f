"""Group buffers, round-robin selection and train-batch collection (docs/system.md §4.6)."""

from __future__ import annotations

import asyncio
import time

import pytest

from miles_runner.multi_lora.buffers import AdapterBuffers, Group, GroupBuffer
from miles_runner.multi_lora.collect import EmptyBatchTimeoutError, collect_batch
from miles_runner.multi_lora.registry import RegistrySnapshot

from .helpers import group, run, sample, snapshot

FAST = {"coalesce_wait_s": 0.05, "empty_wait_s": 0.3}


def buffers_with(*groups: Group, dp_size: int = 1, max_staleness: int | None = None) -> AdapterBuffers:
    buffers = AdapterBuffers(dp_size=dp_size, max_staleness=max_staleness)
    for g in groups:
        buffers.put(g)
    return buffers


def names(groups: list[Group]) -> list[str]:
    return [g.adapter for g in groups]


# ---- GroupBuffer ------------------------------------------------------------------------------------


def test_a_full_buffer_drops_its_oldest_group():
    a = run("a", 0)
    buffer = GroupBuffer(maxlen=2)
    for k in range(3):
        buffer.put(group(a, k))
    assert [g.index for g in buffer.get(5)] == [1, 2] and buffer.overflowed == 1


def test_unstamped_groups_survive_the_foreign_and_stale_filters():
    buffer = GroupBuffer()
    buffer.put(Group("a", 0, [sample()], slot=0))
    assert buffer.drop_foreign("someone-else") == 0 and buffer.drop_stale(100, 0) == 0
    assert len(buffer) == 1


# ---- get_groups -------------------------------------------------------------------------------------


def test_groups_leave_in_whole_dp_chunks():
    a = run("a", 0, rollout_batch_size=4, n_samples_per_prompt=2)  # dp 4: chunks of 2 groups
    buffers = buffers_with(*(group(a, k) for k in range(3)), dp_size=4)
    assert len(buffers.get_groups(snapshot(a), 100, {})) == 2
    assert buffers.buffered("a") == 1


def test_selection_stops_at_the_target():
    a = run("a", 0, rollout_batch_size=8)
    buffers = buffers_with(*(group(a, k) for k in range(8)))
    assert len(buffers.get_groups(snapshot(a), 6, {})) == 3  # 2 samples per group


def test_an_adapter_gives_no_more_than_its_remaining_groups():
    a = run("a", 0, rollout_batch_size=4, accumulated=2)
    buffers = buffers_with(*(group(a, k) for k in range(4)))
    assert len(buffers.get_groups(snapshot(a), 100, {})) == 2


def test_groups_already_in_the_batch_count_against_the_remaining():
    a = run("a", 0, rollout_batch_size=4)
    buffers = buffers_with(*(group(a, k) for k in range(4)))
    assert len(buffers.get_groups(snapshot(a), 100, {"a": 3})) == 1


def test_adapters_take_turns():
    runs = [run(name, slot) for slot, name in enumerate("abc")]
    buffers = buffers_with(*(group(r, k) for r in runs for k in range(2)))
    assert names(buffers.get_groups(snapshot(*runs), 100, {})) == list("abcabc")


def test_the_rotation_cursor_persists_across_calls():
    runs = [run(name, slot) for slot, name in enumerate("abc")]
    buffers = buffers_with(*(group(r, k) for r in runs for k in range(2)))
    firsts = [names(buffers.get_groups(snapshot(*runs), 1, {})) for _ in range(4)]
    assert firsts == [["a"], ["b"], ["c"], ["a"]]


def test_a_retiring_adapter_stays_selectable():
    r = run("r", 0)
    buffers = buffers_with(group(r, 0))
    assert names(buffers.get_groups(snapshot(retiring=(r,)), 100, {})) == ["r"]


def test_groups_of_an_adapter_no_longer_sampleable_are_dropped():
    a, gone = run("a", 0), run("gone", 1)
    buffers = buffers_with(group(a, 0), group(gone, 0), group(gone, 1))
    assert names(buffers.get_groups(snapshot(a), 100, {})) == ["a"]
    assert buffers.dropped["gone", "retired"] == 2 and buffers.buffered("gone") == 0


def test_stale_groups_are_dropped():
    a = run("a", 0, version=5)
    buffers = buffers_with(group(a, 0, version=3), group(a, 1, version=4), max_staleness=1)
    assert [g.index for g in buffers.get_groups(snapshot(a), 100, {})] == [1]
    assert buffers.dropped["a", "stale"] == 1


def test_a_reregistered_name_drops_the_old_tenants_groups():
    new = run("a", 0, registration="new")
    buffers = buffers_with(group(new, 0, registration="old"), group(new, 1, registration="old"), group(new, 2))
    assert [g.index for g in buffers.get_groups(snapshot(new), 100, {})] == [2]
    assert buffers.dropped["a", "foreign"] == 2


# ---- collect_batch ----------------------------------------------------------------------------------


async def test_collect_ships_a_partial_batch_after_the_coalesce_wait():
    a = run("a", 0, rollout_batch_size=8)
    buffers = buffers_with(group(a, 0), group(a, 1))
    batch = await collect_batch(buffers, snapshot(a), target_samples=16, **FAST)
    assert batch.group_counts == {"a": 2} and batch.step_names == []


async def test_collect_reports_the_adapters_that_complete_their_step():
    a, b = run("a", 0, accumulated=2), run("b", 1)
    buffers = buffers_with(*(group(a, k) for k in range(4)), group(b, 0))
    batch = await collect_batch(buffers, snapshot(a, b), target_samples=100, **FAST)
    assert batch.group_counts == {"a": 2, "b": 1}
    assert (batch.step_names, batch.step_slots) == (["a"], [0])


async def test_collect_stops_at_the_target():
    a = run("a", 0, rollout_batch_size=8)
    buffers = buffers_with(*(group(a, k) for k in range(8)))
    batch = await collect_batch(buffers, snapshot(a), target_samples=8, **FAST)
    assert len(batch.samples) == 8


async def test_collect_never_overshoots_an_adapter_across_fetches():
    a = run("a", 0, rollout_batch_size=4)
    buffers = buffers_with(group(a, 0), group(a, 1))

    async def late_groups() -> None:
        await asyncio.sleep(0.02)
        for k in range(2, 8):
            buffers.put(group(a, k))

    feeder = asyncio.create_task(late_groups())
    batch = await collect_batch(buffers, snapshot(a), target_samples=100, coalesce_wait_s=1.0, empty_wait_s=5.0)
    await feeder
    assert batch.group_counts == {"a": 4} and batch.step_names == ["a"]
    assert buffers.buffered("a") == 4


async def test_collect_ships_at_once_when_every_adapter_has_its_step():
    a = run("a", 0, rollout_batch_size=2)
    buffers = buffers_with(group(a, 0), group(a, 1))
    started = time.monotonic()
    await collect_batch(buffers, snapshot(a), target_samples=100, coalesce_wait_s=10.0, empty_wait_s=10.0)
    assert time.monotonic() - started < 1.0


async def test_collect_sorts_groups_by_slot_then_index():
    a, b = run("a", 1), run("b", 0)
    buffers = buffers_with(group(a, 0), group(a, 1), group(b, 0), group(b, 1))
    batch = await collect_batch(buffers, snapshot(a, b), target_samples=100, **FAST)
    assert [(g.slot, g.index) for g in batch.groups] == [(0, 0), (0, 1), (1, 0), (1, 1)]


async def test_collect_raises_empty_batch_timeout_when_nothing_arrives():
    a = run("a", 0)
    with pytest.raises(EmptyBatchTimeoutError):
        await collect_batch(buffers_with(), snapshot(a), target_samples=8, **FAST)


async def test_collect_needs_a_sampleable_adapter():
    with pytest.raises(ValueError, match="sampleable"):
        await collect_batch(buffers_with(), RegistrySnapshot(), target_samples=8, **FAST)


async def test_a_dead_producer_surfaces_its_cause():
    buffers = buffers_with()
    buffers.fail(ConnectionError("engine gone"))
    with pytest.raises(RuntimeError, match="producer died") as caught:
        await collect_batch(buffers, snapshot(run("a", 0)), target_samples=8, **FAST)
    assert isinstance(caught.value.__cause__, ConnectionError)
