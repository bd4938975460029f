"""MultiLoRALoop: the top-level sequence of one multi-LoRA run, each job done by the package's other modules."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from miles_runner.executors.controller_service import controller_service
from miles_runner.executors.local import Deployment
from miles_runner.executors.ray import make_executor
from miles_runner.loops.multi_lora.checkpoints import AdapterCheckpoints
from miles_runner.loops.multi_lora.events import EVENTS_FILE, EventLog
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
from miles_runner.plan.model import Plan
from miles_runner.procs.heap import freeze_startup_heap
from miles_runner.rollout.context import RolloutContext, rollout_engines
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.sglang_client.client import EngineClient, EngineError, EngineUnavailable
from miles_runner.sglang_client.engine_pool import EnginePool
from miles_runner.trainer.ranks import make_trainer
from miles_runner.weight_sync.probe import PushProbe, probe_token_ids
from miles_runner.weight_sync.sync import make_sync

log = logging.getLogger(__package__)  # the loop's logger, named as before the split into modules

CACHE_TTL_S = 0.2  # the producer learns of new and retired adapters within this


class MultiLoRALoop:
    """Many adapters, one base model, shared engines: reconcile -> push -> collect -> train -> record -> checkpoint."""

    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False) -> None:
        if plan.multi_lora is None:
            raise ValueError(f"plan {plan.name!r} is not a multi-LoRA plan (adapters=multi)")
        self.plan, self.run_dir, self.resume = plan, Path(run_dir), resume
        self.events = EventLog(self.run_dir / EVENTS_FILE)

    def run(self) -> list[dict[str, Any]]:
        """Start the deployment and the controller service, train until done; returns the step records."""
        self.executor = make_executor(self.plan, self.run_dir)
        with self.executor as deployment, controller_service(self.plan, self.run_dir):
            return asyncio.run(self._main(deployment))

    async def _main(self, deployment: Deployment) -> list[dict[str, Any]]:
        self.trainer = make_trainer(self.plan, self.run_dir, deployment.remote_ranks)
        try:
            return await self._serve(deployment)
        finally:
            self.trainer.close()  # the other trainer ranks leave

    async def _serve(self, deployment: Deployment) -> list[dict[str, Any]]:
        """The producer fills the adapters' buffers while the loop runs; everything is closed after it."""
        # groups spread over the engines
        rollout_client = rollout_engines(self.plan, deployment.engine_urls, api_key=deployment.api_key)
        producer = self._connect(deployment, rollout_client)
        self._assemble(deployment.trainer_address)
        freeze_startup_heap()  # the trainer, clients and imports: alive for the whole run
        producer.start()
        try:
            await self._loop()
        finally:
            await producer.stop()
            await self.rollout.aclose()
            await self.sync.close()
            self.tracker.close()
            plot_adapters(self.plan, self.tracker.records, self.run_dir)
            for client in [*self.engines, rollout_client, self.controller]:
                await client.aclose()
        return self.tracker.records

    def _connect(self, deployment: Deployment, rollout_client: EnginePool) -> GroupProducer:
        """Clients of the engines and the controller, the rollout, the buffers and the producer that fills them."""
        plan, m = self.plan, self.plan.multi_lora
        key = deployment.api_key  # the run's key: the engines, the session server and the controller require it
        self.engines = [EngineClient(url, api_key=key) for url in deployment.engine_urls]
        self.controller = ControllerClient(m.launch.url, api_token=key)
        cache = AdaptersCache(self.controller.snapshot, ttl_s=CACHE_TTL_S)
        ctx = RolloutContext.from_plan(plan, rollout_client, deployment.session_url, api_key=key)
        # Failing requests are tolerated while a lost engine can be noticed (a collect times out) and restarted.
        grace_s = m.max_empty_wait_s + plan.executor.health_timeout_s
        self.rollout = MultiLoRARollout(ctx, cache, seed=plan.seed, unreachable_grace_s=grace_s)
        self.buffers = AdapterBuffers(plan.trainer.parallel.dp, plan.rollout.max_weight_staleness)
        return GroupProducer(
            cache, self.buffers, self.rollout.next_prompt, self.rollout.generate_group, concurrency=2 * m.slots
        )

    def _assemble(self, trainer_address: str) -> None:
        """The collaborators that do the loop's jobs, and the tracker (from the resumed iteration on)."""
        self.sync = make_sync(self.plan, self.engines, trainer_address=trainer_address)  # every push names its slot
        self.checkpoints = AdapterCheckpoints(self.plan.checkpoint, self.trainer, self.rollout, self.controller)
        sync, model = self.plan.weight_sync, self.plan.model_path
        probe = PushProbe(self.engines, probe_token_ids(model), sync.max_logprob_gap) if sync.verify else None
        self.pushes = Pushes(self.engines, self.sync, self.trainer, self.controller, self.events, probe)
        self.reconciler = Reconciler(
            self.controller,
            self.trainer,
            self.rollout,
            self.pushes,
            self.checkpoints,
            self.events,
            default_num_steps=self.plan.batch.num_steps,
        )
        self.recovery = EngineRecovery(self.executor, self.events)
        self.records = StepRecords(self.rollout, self.buffers)
        self.iteration = first_iteration(self.run_dir, self.resume)
        self.tracker = make_tracker(self.plan, self.run_dir, self.iteration)

    # ---- the loop -----------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while await self._has_work():
            await self._iterate()

    async def _has_work(self) -> bool:
        """Bounded mode ends when no adapter is left to load, train or clean up; service mode waits for some."""
        m = self.plan.multi_lora
        while not (await self.controller.snapshot()).has_work:
            if not m.service_mode:
                return False
            await asyncio.sleep(m.idle_poll_s)
        return True

    async def _iterate(self) -> None:
        """reconcile -> push -> collect a batch -> train -> record -> checkpoint; a pass with nothing to train
        (an engine restarted, nothing sampleable yet, no group arrived) ends early and the next one starts over."""
        await self.reconciler.reconcile(self.iteration)
        sync_s = await self._push()
        if sync_s is None:
            return  # an engine restarted: the next pass pushes every adapter to it
        snapshot = await self.controller.snapshot()
        if not snapshot.sampleable:
            await asyncio.sleep(CACHE_TTL_S)
            return
        batch, collect_s = await self._collect(snapshot)
        if batch is None:
            return
        metrics, stepped, train_s = await self._train(batch)
        timings = {"batch/collect_seconds": collect_s, "sync/seconds": sync_s, "train/seconds": train_s}
        await self._record(snapshot, batch, metrics, stepped, timings)
        self.iteration += 1

    async def _push(self) -> float | None:
        """Restart dead engines, then push; None when an engine died under the push and was restarted."""
        try:
            await self.recovery.restart_dead(self.iteration)
            return await self._update_weights()
        except (EngineUnavailable, EngineError, RuntimeError) as error:
            if not await self.recovery.restarted_after(error, self.iteration):
                raise
            return None

    async def _update_weights(self) -> float:
        """Push the adapters that stepped or are new (every loaded one to new engines); returns the seconds.
        Runs after the check for dead engines (fault-injection tests override it to kill one mid-push)."""
        return await self.pushes.update(self.reconciler.loaded, self.iteration)

    async def _collect(self, snapshot: RegistrySnapshot) -> tuple[TrainBatch | None, float]:
        """A batch of the sampleable adapters' groups and the seconds it took; None when none arrived in time."""
        m = self.plan.multi_lora
        self.tracker.phase(self.iteration, "rollout")
        started = time.perf_counter()
        try:
            batch = await collect_batch(
                self.buffers,
                snapshot,
                target_samples=self.plan.batch.global_batch_size,
                coalesce_wait_s=m.max_coalesce_wait_s,
                empty_wait_s=m.max_empty_wait_s,
            )
        except EmptyBatchTimeoutError as error:
            log.warning("%s; reconciling and trying again", error)
            return None, 0.0
        return batch, time.perf_counter() - started

    async def _train(self, batch: TrainBatch) -> tuple[SlotMetrics, list[str], float]:
        """Train the batch: (metrics by slot, the adapters that stepped, seconds). Only after a successful train
        does the controller count their steps, and the next push carry their new weights."""
        rollout_id = f"{self.run_dir.name}-{self.iteration}"
        await self.controller.record_batch_adapters(rollout_id, batch.group_counts, batch.step_names)
        self.tracker.phase(self.iteration, "train")
        started = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train, batch.samples, batch.step_slots)
        train_s = time.perf_counter() - started
        stepped = await self.controller.mark_batch_trained(rollout_id)
        self.pushes.want(stepped)
        self.events.write(
            self.iteration,
            "trained",
            step_names=stepped,
            groups=[[g.adapter, g.slot, g.slot_version, g.registration_id, g.index] for g in batch.groups],
        )
        return metrics, stepped, train_s

    async def _record(
        self,
        snapshot: RegistrySnapshot,
        batch: TrainBatch,
        metrics: SlotMetrics,
        stepped: list[str],
        timings: dict[str, float],
    ) -> None:
        """The iteration's record (metrics.jsonl, wandb, progress), then each stepped adapter's checkpoint if due."""
        steps = {name: (await self.controller.adapter_step(name)) for name in stepped}
        record = self.records.record(self.iteration, snapshot, batch, metrics, steps, timings)
        self.tracker.step_done(self.iteration, record)
        for name, step in steps.items():
            self.checkpoints.save_if_due(self.reconciler.loaded[name], step)
