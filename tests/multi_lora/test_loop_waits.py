"""How the multi-LoRA loop waits, as its plan says: for adapters (adapters.service_mode, adapters.idle_poll_s) from a
real controller served over loopback HTTP, and for groups (adapters.max_coalesce_wait_s, adapters.max_empty_wait_s)
in its buffers; and where it must not wait: for an engine to die after a push whose probe failed. The loop is built
from the plan and driven one waiting step at a time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.local import LocalExecutor
from miles_runner.loops.multi_lora import MultiLoRALoop
from miles_runner.loops.multi_lora.events import EventLog
from miles_runner.loops.multi_lora.records import make_tracker
from miles_runner.loops.multi_lora.recovery import ENGINE_DEATH_WAIT_S, EngineRecovery
from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.http_server import create_app
from miles_runner.multi_lora.settings import settings_from_plan
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.weight_sync.verify import SyncVerificationError

from .helpers import group, run, serve, snapshot

pytestmark = pytest.mark.integration

STILL_WAITING_S = 0.5  # long enough for a loop that would not wait to have returned
RETURNED_S = 30.0  # a loop that waits briefly returns well within this


def plan_of(*overrides: str) -> Plan:
    return compile_plan(compose(["+recipe=tiny_multi_lora", "logger.wandb_mode=disabled", *overrides]))


@contextlib.asynccontextmanager
async def loop_on_controller(plan: Plan, run_dir: Path) -> AsyncIterator[MultiLoRALoop]:
    """The plan's loop talking to the plan's controller (nothing registered at start) over loopback HTTP."""
    settings = dataclasses.replace(settings_from_plan(plan, run_dir), adapters=())
    async with serve(create_app(settings.build_controller())) as [url]:
        loop = MultiLoRALoop(plan, run_dir)
        loop.controller = ControllerClient(url)
        try:
            yield loop
        finally:
            await loop.controller.aclose()


async def still_waiting(task: asyncio.Task) -> bool:
    await asyncio.sleep(STILL_WAITING_S)
    waiting = not task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return waiting


# ---- adapters.service_mode, adapters.idle_poll_s ----


async def test_a_bounded_run_ends_when_no_adapter_is_left(tmp_path):
    async with loop_on_controller(plan_of("adapters.service_mode=false"), tmp_path) as loop:
        assert await asyncio.wait_for(loop._has_work(), RETURNED_S) is False


async def test_service_mode_waits_for_an_adapter_and_polls_every_idle_poll_s(tmp_path):
    plan = plan_of("adapters.runs=[]", "adapters.service_mode=true", "adapters.idle_poll_s=0.05")
    async with loop_on_controller(plan, tmp_path) as loop:
        waiting = asyncio.create_task(loop._has_work())
        await asyncio.sleep(STILL_WAITING_S)
        assert not waiting.done(), "service mode ended with no adapter registered"
        await loop.controller.register_adapter("late", {})
        assert await asyncio.wait_for(waiting, RETURNED_S) is True


async def test_service_mode_sees_a_new_adapter_only_at_its_next_poll(tmp_path):
    plan = plan_of("adapters.runs=[]", "adapters.service_mode=true", "adapters.idle_poll_s=3600")
    async with loop_on_controller(plan, tmp_path) as loop:
        waiting = asyncio.create_task(loop._has_work())
        await asyncio.sleep(0.1)  # it has polled once and sleeps
        await loop.controller.register_adapter("late", {})
        assert await still_waiting(waiting), "the loop polled again before idle_poll_s"


# ---- adapters.max_coalesce_wait_s, adapters.max_empty_wait_s ----


def collecting_loop(plan: Plan, run_dir: Path) -> MultiLoRALoop:
    """The plan's loop with what its collect step reads: buffers, a tracker and the iteration."""
    loop = MultiLoRALoop(plan, run_dir)
    loop.buffers = AdapterBuffers(plan.trainer.parallel.dp, plan.rollout.max_weight_staleness)
    loop.tracker = make_tracker(plan, run_dir, 0)
    loop.iteration = 0
    return loop


async def test_an_empty_collect_gives_up_after_max_empty_wait_s(tmp_path):
    loop = collecting_loop(plan_of("adapters.max_empty_wait_s=0.05"), tmp_path)
    batch, _ = await asyncio.wait_for(loop._collect(snapshot(run("a", 0))), RETURNED_S)
    assert batch is None  # the loop reconciles and tries again


async def test_an_empty_collect_waits_for_max_empty_wait_s(tmp_path):
    loop = collecting_loop(plan_of("adapters.max_empty_wait_s=3600"), tmp_path)
    assert await still_waiting(asyncio.create_task(loop._collect(snapshot(run("a", 0)))))


async def test_a_partial_batch_ships_once_no_group_arrived_for_max_coalesce_wait_s(tmp_path):
    loop = collecting_loop(plan_of("adapters.max_coalesce_wait_s=0.05"), tmp_path)
    a = run("a", 0, rollout_batch_size=8)
    loop.buffers.put(group(a, 0))
    batch, _ = await asyncio.wait_for(loop._collect(snapshot(a)), RETURNED_S)
    assert batch.group_counts == {"a": 1} and batch.step_names == []


async def test_a_long_coalesce_wait_holds_the_batch_until_the_adapters_step_is_complete(tmp_path):
    loop = collecting_loop(plan_of("adapters.max_coalesce_wait_s=3600"), tmp_path)
    a = run("a", 0, rollout_batch_size=8)
    loop.buffers.put(group(a, 0))
    collecting = asyncio.create_task(loop._collect(snapshot(a)))
    await asyncio.sleep(STILL_WAITING_S)
    assert not collecting.done(), "a partial batch shipped before max_coalesce_wait_s"
    for index in range(1, 8):  # the rest of the adapter's step: nothing more to wait for
        loop.buffers.put(group(a, index))
    batch, _ = await asyncio.wait_for(collecting, RETURNED_S)
    assert batch.group_counts == {"a": 8} and batch.step_names == ["a"]


# ---- a push whose probe failed: the engines answered, so none died ----


class ProbeBreach(MultiLoRALoop):
    """Fault injection: the push's probe finds the engines' adapter differing from the trainer's slot."""

    async def _update_weights(self) -> float:
        raise SyncVerificationError("weight version 1: the probe of adapter '__miles_slot_0' differs (injected)")


async def test_a_push_whose_probe_failed_ends_the_run_without_waiting_for_an_engine_to_die(tmp_path):
    plan = plan_of()
    loop = ProbeBreach(plan, tmp_path)
    loop.executor, loop.iteration = LocalExecutor(plan, tmp_path), 0  # started nothing: no engine is dead
    loop.recovery = EngineRecovery(loop.executor, EventLog(tmp_path / "events.jsonl"))
    # A failed push is forgiven when an engine died under it, which may take ENGINE_DEATH_WAIT_S to be seen.
    with pytest.raises(SyncVerificationError, match="injected"):
        await asyncio.wait_for(loop._push(), ENGINE_DEATH_WAIT_S / 2)
