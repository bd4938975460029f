"""MultiLoRALoop: one multi-LoRA run, top to bottom. `_train` builds the run's parts in one place, then iterates
(docs/system.md §4.7): reconcile -> push -> collect a batch -> train -> record -> checkpoint, each job done by one
of the package's other modules."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.executors.controller_service import choose_controller_port, controller_service
from miles_runner.executors.local import Deployment
from miles_runner.executors.ray import make_executor
from miles_runner.loops.multi_lora.checkpoints import AdapterCheckpoints
from miles_runner.loops.multi_lora.pushes import Pushes
from miles_runner.loops.multi_lora.reconcile import Reconciler
from miles_runner.loops.multi_lora.records import SlotMetrics, StepRecords, first_iteration, make_tracker, plot_adapters
from miles_runner.loops.multi_lora.recovery import EngineRecovery
from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.collect import EmptyBatchTimeoutError, TrainBatch, collect_batch
from miles_runner.multi_lora.producer import GroupProducer
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.plan.model import MultiLoRAPlan, Plan
from miles_runner.procs.heap import freeze_startup_heap
from miles_runner.rollout.context import RolloutContext, rollout_engines
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.sglang_client.client import EngineClient
from miles_runner.tracking.event_log import EventLog
from miles_runner.tracking.tracker import Tracker
from miles_runner.trainer.host import open_multi_lora_trainer
from miles_runner.trainer.interface import MultiLoRATrainer
from miles_runner.weight_sync.probe import PushProbe, probe_token_ids
from miles_runner.weight_sync.sync import make_sync

EVENTS_FILE = "multi_lora_events.jsonl"  # tracking/event_log.py

log = logging.getLogger(__package__)  # the loop's logger, named as before the split into modules

CACHE_TTL_S = 0.2  # the producer learns of new and retired adapters within this


@dataclass(frozen=True)
class LoopParts:
    """What every iteration uses; built once, in `MultiLoRALoop._train`."""

    trainer: MultiLoRATrainer
    controller: ControllerClient
    buffers: AdapterBuffers  # the producer's finished groups, by adapter
    reconciler: Reconciler  # the trainer's slots follow the registry
    pushes: Pushes  # the adapters that stepped or are new reach the engines
    recovery: EngineRecovery  # engines that died are started again
    records: StepRecords
    checkpoints: AdapterCheckpoints
    tracker: Tracker


class MultiLoRALoop:
    """Many adapters, one base model, shared engines: reconcile -> push -> collect -> train -> record -> checkpoint."""

    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False) -> None:
        if plan.multi_lora is None:
            raise ValueError(f"plan {plan.name!r} is not a multi-LoRA plan (adapters=multi)")
        self.plan, self.settings, self.run_dir, self.resume = plan, plan.multi_lora, Path(run_dir), resume
        self.executor = make_executor(plan, self.run_dir)
        self.events = EventLog(self.run_dir / EVENTS_FILE)

    def run(self) -> list[dict[str, Any]]:
        """Start the deployment and the controller service, train until done; returns the step records."""
        with self.executor as deployment:
            plan = choose_controller_port(deployment.plan, self.run_dir)  # the plan as it runs: its ports chosen
            with controller_service(plan, self.run_dir):
                return asyncio.run(self._train(deployment, plan))

    async def _train(self, deployment: Deployment, plan: Plan) -> list[dict[str, Any]]:
        """Build the run's parts, start the producer filling the adapters' buffers, then iterate while an adapter is
        left to load, train or clean up (service mode: for ever); everything is closed after, in reverse order."""
        m = plan.multi_lora
        assert m is not None  # checked in __init__
        key = deployment.api_key  # the run's key: the engines, the session server and the controller require it
        async with contextlib.AsyncExitStack() as stack:
            trainer = open_multi_lora_trainer(plan, self.run_dir, deployment.remote_ranks)
            stack.callback(trainer.close)  # the other trainer ranks leave
            engines = [await stack.enter_async_context(EngineClient(u, api_key=key)) for u in deployment.engine_urls]
            controller = await stack.enter_async_context(ControllerClient(m.launch.url, api_token=key))
            # Rollouts spread their groups over the engines.
            pool = await stack.enter_async_context(rollout_engines(plan, deployment.engine_urls, api_key=key))
            ctx = RolloutContext.from_plan(plan, pool, deployment.session_url, api_key=key)
            cache = AdaptersCache(controller.snapshot, ttl_s=CACHE_TTL_S)
            # Failing requests are tolerated while a lost engine can be noticed (a collect times out) and restarted.
            grace_s = m.max_empty_wait_s + plan.executor.health_timeout_s
            rollout = MultiLoRARollout(ctx, cache, seed=plan.seed, unreachable_grace_s=grace_s)
            stack.push_async_callback(rollout.aclose)
            sync = make_sync(plan, engines, trainer_address=deployment.trainer_address)  # every push names its slot
            stack.push_async_callback(sync.close)
            probe = None
            if plan.weight_sync.verify:  # every engine scores the probe under the adapter it was just pushed
                probe = PushProbe(engines, probe_token_ids(plan.model_path), plan.weight_sync.max_logprob_gap)
            pushes = Pushes(engines, sync, trainer, controller, self.events, probe)
            checkpoints = AdapterCheckpoints(plan.checkpoint, trainer, rollout, controller)
            reconciler = Reconciler(
                controller, trainer, rollout, pushes, checkpoints, self.events, default_num_steps=plan.batch.num_steps
            )
            buffers = AdapterBuffers(plan.trainer.parallel.dp, plan.rollout.max_weight_staleness)
            iteration = first_iteration(self.run_dir, self.resume)
            tracker = make_tracker(plan, self.run_dir, iteration)
            stack.callback(self._close_tracker, tracker)
            recovery, records = EngineRecovery(self.executor, self.events), StepRecords(rollout, buffers)
            parts = LoopParts(trainer, controller, buffers, reconciler, pushes, recovery, records, checkpoints, tracker)
            producer = GroupProducer(
                cache, buffers, rollout.next_prompt, rollout.generate_group, concurrency=2 * m.slots
            )
            freeze_startup_heap()  # the trainer, clients and imports: alive for the whole run
            producer.start()
            stack.push_async_callback(producer.stop)
            while await has_work(controller, m):
                if await self._iterate(parts, iteration):
                    iteration += 1
        return tracker.records

    def _close_tracker(self, tracker: Tracker) -> None:
        tracker.close()
        plot_adapters(self.plan, tracker.records, self.run_dir)

    # ---- one iteration ------------------------------------------------------------------------------

    async def _iterate(self, parts: LoopParts, iteration: int) -> bool:
        """reconcile -> push -> collect a batch -> train -> record -> checkpoint; False for a pass that trained
        nothing (an engine restarted, nothing sampleable yet, no group arrived): the next one starts over."""
        await parts.reconciler.reconcile(iteration)
        sync_s = await parts.recovery.push_or_restart(
            functools.partial(self._update_weights, parts, iteration), iteration
        )
        if sync_s is None:
            return False  # an engine restarted: the next pass pushes every adapter to it
        snapshot = await parts.controller.snapshot()
        if not snapshot.sampleable:
            await asyncio.sleep(CACHE_TTL_S)
            return False
        parts.tracker.phase(iteration, "rollout")
        batch, collect_s = await collect(parts.buffers, snapshot, self.settings, self.plan.batch.global_batch_size)
        if batch is None:
            return False
        metrics, stepped, train_s = await self._train_batch(parts, batch, iteration)
        timings = {"batch/collect_seconds": collect_s, "sync/seconds": sync_s, "train/seconds": train_s}
        await self._record(parts, iteration, snapshot, batch, metrics, stepped, timings)
        return True

    async def _update_weights(self, parts: LoopParts, iteration: int) -> float:
        """Push the adapters that stepped or are new (every loaded one to new engines); returns the seconds.
        Runs after the check for dead engines (fault-injection tests override it to kill one mid-push)."""
        return await parts.pushes.update(parts.reconciler.loaded, iteration)

    async def _train_batch(
        self, parts: LoopParts, batch: TrainBatch, iteration: int
    ) -> tuple[SlotMetrics, list[str], float]:
        """Train the batch: (metrics by slot, the adapters that stepped, seconds). Only after a successful train
        does the controller count their steps, and the next push carry their new weights."""
        rollout_id = f"{self.run_dir.name}-{iteration}"
        await parts.controller.record_batch_adapters(rollout_id, batch.group_counts, batch.step_names)
        parts.tracker.phase(iteration, "train")
        started = time.perf_counter()
        metrics = await asyncio.to_thread(parts.trainer.train, batch.samples, batch.step_slots)
        train_s = time.perf_counter() - started
        stepped = await parts.controller.mark_batch_trained(rollout_id)
        parts.pushes.want(stepped)
        self.events.write(
            iteration,
            "trained",
            step_names=stepped,
            groups=[[g.adapter, g.slot, g.slot_version, g.registration_id, g.index] for g in batch.groups],
        )
        return metrics, stepped, train_s

    async def _record(
        self,
        parts: LoopParts,
        iteration: int,
        snapshot: RegistrySnapshot,
        batch: TrainBatch,
        metrics: SlotMetrics,
        stepped: list[str],
        timings: dict[str, float],
    ) -> None:
        """The iteration's record (metrics.jsonl, wandb, progress), then each stepped adapter's checkpoint if due."""
        steps = {name: (await parts.controller.adapter_step(name)) for name in stepped}
        record = parts.records.record(iteration, snapshot, batch, metrics, steps, timings)
        parts.tracker.step_done(iteration, record)
        for name, step in steps.items():
            parts.checkpoints.save_if_due(parts.reconciler.loaded[name], step)


async def has_work(controller: ControllerClient, settings: MultiLoRAPlan) -> bool:
    """Bounded mode ends when no adapter is left to load, train or clean up; service mode waits for some."""
    while not (await controller.snapshot()).has_work:
        if not settings.service_mode:
            return False
        await asyncio.sleep(settings.idle_poll_s)
    return True


async def collect(
    buffers: AdapterBuffers, snapshot: RegistrySnapshot, settings: MultiLoRAPlan, target_samples: int
) -> tuple[TrainBatch | None, float]:
    """A batch of the sampleable adapters' groups and the seconds it took; None when none arrived in time."""
    started = time.perf_counter()
    try:
        batch = await collect_batch(
            buffers,
            snapshot,
            target_samples=target_samples,
            coalesce_wait_s=settings.max_coalesce_wait_s,
            empty_wait_s=settings.max_empty_wait_s,
        )
    except EmptyBatchTimeoutError as error:
        log.warning("%s; reconciling and trying again", error)
        return None, 0.0
    return batch, time.perf_counter() - started
