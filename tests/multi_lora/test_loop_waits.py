"""How the multi-LoRA loop waits, as its plan says: for adapters (adapters.service_mode, adapters.idle_poll_s) from a
real controller served over loopback HTTP, and for groups (adapters.max_coalesce_wait_s, adapters.max_empty_wait_s)
in its buffers; and where it must not wait: for an engine to die after a push whose probe failed. Each waiting step
of the loop (loops/multi_lora/loop.py, recovery.py) is driven on its own, with the plan's settings."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.local import LocalExecutor
from miles_runner.loops.multi_lora.loop import collect, has_work
from miles_runner.loops.multi_lora.recovery import ENGINE_DEATH_WAIT_S, EngineRecovery
from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.collect import TrainBatch
from miles_runner.multi_lora.http_server import create_app
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.multi_lora.settings import settings_from_plan
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.tracking.event_log import EventLog
from miles_runner.weight_sync.verify import SyncVerificationError

from .helpers import group, run, serve, snapshot

pytestmark = pytest.mark.integration

STILL_WAITING_S = 0.5  # long enough for a loop that would not wait to have returned
RETURNED_S = 30.0  # a loop that waits briefly returns well within this


def plan_of(*overrides: str) -> Plan:
    return compile_plan(compose(["+recipe=tiny_multi_lora", "logger.wandb_mode=disabled", *overrides]))


@contextlib.asynccontextmanager
async def plans_controller(plan: Plan, run_dir: Path) -> AsyncIterator[ControllerClient]:
    """A client of the plan's controller (nothing registered at start), served over loopback HTTP."""
    settings = dataclasses.replace(settings_from_plan(plan, run_dir), adapters=())
    async with serve(create_app(settings.build_controller())) as [url], ControllerClient(url) as controller:
        yield controller


async def still_waiting(task: asyncio.Task) -> bool:
    await asyncio.sleep(STILL_WAITING_S)
    waiting = not task.done()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return waiting


# ---- adapters.service_mode, adapters.idle_poll_s ----


async def test_a_bounded_run_ends_when_no_adapter_is_left(tmp_path):
    plan = plan_of("adapters.service_mode=false")
    async with plans_controller(plan, tmp_path) as controller:
        assert await asyncio.wait_for(has_work(controller, plan.multi_lora), RETURNED_S) is False


async def test_service_mode_waits_for_an_adapter_and_polls_every_idle_poll_s(tmp_path):
    plan = plan_of("adapters.runs=[]", "adapters.service_mode=true", "adapters.idle_poll_s=0.05")
    async with plans_controller(plan, tmp_path) as controller:
        waiting = asyncio.create_task(has_work(controller, plan.multi_lora))
        await asyncio.sleep(STILL_WAITING_S)
        assert not waiting.done(), "service mode ended with no adapter registered"
        await controller.register_adapter("late", {})
        assert await asyncio.wait_for(waiting, RETURNED_S) is True


async def test_service_mode_sees_a_new_adapter_only_at_its_next_poll(tmp_path):
    plan = plan_of("adapters.runs=[]", "adapters.service_mode=true", "adapters.idle_poll_s=3600")
    async with plans_controller(plan, tmp_path) as controller:
        waiting = asyncio.create_task(has_work(controller, plan.multi_lora))
        await asyncio.sleep(0.1)  # it has polled once and sleeps
        await controller.register_adapter("late", {})
        assert await still_waiting(waiting), "the loop polled again before idle_poll_s"


# ---- adapters.max_coalesce_wait_s, adapters.max_empty_wait_s ----


def buffers_of(plan: Plan) -> AdapterBuffers:
    return AdapterBuffers(plan.trainer.parallel.dp, plan.rollout.max_weight_staleness)


async def collect_as_planned(
    plan: Plan, buffers: AdapterBuffers, of: RegistrySnapshot
) -> tuple[TrainBatch | None, float]:
    """The loop's collect step over `buffers`, with the plan's settings."""
    return await collect(buffers, of, plan.multi_lora, plan.batch.global_batch_size)


async def test_an_empty_collect_gives_up_after_max_empty_wait_s():
    plan = plan_of("adapters.max_empty_wait_s=0.05")
    batch, _ = await asyncio.wait_for(collect_as_planned(plan, buffers_of(plan), snapshot(run("a", 0))), RETURNED_S)
    assert batch is None  # the loop reconciles and tries again


async def test_an_empty_collect_waits_for_max_empty_wait_s():
    plan = plan_of("adapters.max_empty_wait_s=3600")
    assert await still_waiting(asyncio.create_task(collect_as_planned(plan, buffers_of(plan), snapshot(run("a", 0)))))


async def test_a_partial_batch_ships_once_no_group_arrived_for_max_coalesce_wait_s():
    plan = plan_of("adapters.max_coalesce_wait_s=0.05")
    buffers, a = buffers_of(plan), run("a", 0, rollout_batch_size=8)
    buffers.put(group(a, 0))
    batch, _ = await asyncio.wait_for(collect_as_planned(plan, buffers, snapshot(a)), RETURNED_S)
    assert batch.group_counts == {"a": 1} and batch.step_names == []


async def test_a_long_coalesce_wait_holds_the_batch_until_the_adapters_step_is_complete():
    plan = plan_of("adapters.max_coalesce_wait_s=3600")
    buffers, a = buffers_of(plan), run("a", 0, rollout_batch_size=8)
    buffers.put(group(a, 0))
    collecting = asyncio.create_task(collect_as_planned(plan, buffers, snapshot(a)))
    await asyncio.sleep(STILL_WAITING_S)
    assert not collecting.done(), "a partial batch shipped before max_coalesce_wait_s"
    for index in range(1, 8):  # the rest of the adapter's step: nothing more to wait for
        buffers.put(group(a, index))
    batch, _ = await asyncio.wait_for(collecting, RETURNED_S)
    assert batch.group_counts == {"a": 8} and batch.step_names == ["a"]


# ---- a push whose probe failed: the engines answered, so none died ----


async def probe_breach() -> float:
    """Fault injection: the push's probe finds the engines' adapter differing from the trainer's slot."""
    raise SyncVerificationError("weight version 1: the probe of adapter '__miles_slot_0' differs (injected)")


async def test_a_push_whose_probe_failed_ends_the_run_without_waiting_for_an_engine_to_die(tmp_path):
    plan = plan_of()
    executor = LocalExecutor(plan, tmp_path)  # started nothing: no engine is dead
    recovery = EngineRecovery(executor, EventLog(tmp_path / "events.jsonl"))
    # A failed push is forgiven when an engine died under it, which may take ENGINE_DEATH_WAIT_S to be seen.
    with pytest.raises(SyncVerificationError, match="injected"):
        await asyncio.wait_for(recovery.push_or_restart(probe_breach, 0), ENGINE_DEATH_WAIT_S / 2)
