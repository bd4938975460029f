"""The multi-LoRA training loop (spec §4.7, train_multi_lora_async.py): many adapters, one base model, shared engines.

    controller service (plan.multi_lora.launch; under a Ray actor with executor=ray)
    -> producer (groups for every live adapter, always running)
    loop: reconcile (retire -> clean up -> load) -> push adapters that stepped or are new -> collect a batch
          -> record its adapters -> train -> mark it trained (only after a successful train) -> log, checkpoint

Engines that died are restarted before each push (at most `executor.engine_restarts` times each); an engine
that does not report the last pushed weight version is new (the run's start, a restart here or elsewhere), and
then every loaded adapter is pushed again, through a fresh weight-update group.

Bounded mode ends when no adapter is left to load, train or clean up (each retires itself after its num_step);
service mode waits for registrations instead. Every iteration appends a record to metrics.jsonl with
per-adapter namespaces (`{adapter}/reward/mean`, `{adapter}/train/loss`, `{adapter}/step`, ...), and a line to
multi_lora_events.jsonl (what was retired, loaded, cleaned up, pushed and trained, with each trained group's
stamps) for audits. Each adapter checkpoints into its own save folder (`<save>/checkpoints/step_N`: adapter,
optimizer, step, data cursor) and resumes from it when it is loaded again.

Run it on a recorded plan: `python -m miles_runner.loops.run RUN_DIR [--resume]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from miles_runner.core.adapters import slot_lora_name
from miles_runner.engine.client import EngineClient, EngineError, EngineUnavailable
from miles_runner.executors.controller import controller_service
from miles_runner.executors.ray import make_executor
from miles_runner.loops.checkpoint import completed_steps, load_latest, save_checkpoint
from miles_runner.lora.sync import make_sync
from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.collect import EmptyBatchTimeoutError, collect_batch
from miles_runner.multi_lora.producer import GroupProducer
from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot
from miles_runner.multi_lora.settings import TOKEN_ENV
from miles_runner.plan.model import AdapterPlan, Plan
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.tracking.metrics import MetricsFile
from miles_runner.tracking.plots import plot_metrics
from miles_runner.tracking.tracker import Tracker
from miles_runner.trainer.ranks import make_trainer

log = logging.getLogger(__name__)

EVENTS_FILE = "multi_lora_events.jsonl"
CACHE_TTL_S = 0.2  # the producer learns of new and retired adapters within this
ENGINE_DEATH_WAIT_S = 10.0  # after a failed push: how long an engine may take to be seen dead


def adapter_plan(run: AdapterRun) -> AdapterPlan:
    """The trainer's view of a registered adapter (its peft adapter is named as its engine slot)."""
    c = run.config
    return AdapterPlan(
        name=run.name, lora_path=slot_lora_name(run.slot), rank=c.rank, alpha=c.alpha, dropout=0.0,
        target_modules=list(c.target_modules), task=c.task, reward=c.reward, lr=c.lr,
        rollout_batch_size=c.rollout_batch_size, n_samples_per_prompt=c.n_samples_per_prompt,
        num_step=c.num_step, num_epoch=c.num_epoch, data=c.data, agent=c.agent,
    )  # fmt: skip


class EventLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, iteration: int, event: str, **fields: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps({"iteration": iteration, "event": event, **fields}) + "\n")


class MultiLoRALoop:
    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False) -> None:
        if plan.multi_lora is None:
            raise ValueError(f"plan {plan.name!r} is not a multi-LoRA plan (adapters=multi)")
        self.plan, self.run_dir, self.resume = plan, Path(run_dir), resume
        self.loaded: dict[str, AdapterRun] = {}  # adapters whose slot the trainer holds, as loaded
        self.to_push: set[str] = set()  # loaded adapters the engines do not have the latest weights of
        self.pushes = 0  # weight pushes so far: each sets the engines' weight_version to this count
        self.events = EventLog(self.run_dir / EVENTS_FILE)
        self._rate_mark: tuple[float | None, int] = (None, 0)  # (time, tokens generated) at the last record

    def run(self) -> list[dict[str, Any]]:
        self.executor = make_executor(self.plan, self.run_dir)
        with self.executor as deployment, controller_service(self.plan, self.run_dir):
            return asyncio.run(self._main(deployment))

    async def _main(self, deployment) -> list[dict[str, Any]]:
        self.trainer = make_trainer(self.plan, self.run_dir)
        try:
            return await self._serve(deployment)
        finally:
            self.trainer.close()  # the other trainer ranks leave

    async def _serve(self, deployment) -> list[dict[str, Any]]:
        plan, m = self.plan, self.plan.multi_lora
        self.engines = [EngineClient(url) for url in deployment.engine_urls]
        rollout_client = EngineClient(deployment.rollout_url)
        self.controller = ControllerClient(m.launch.url, api_token=os.environ.get(TOKEN_ENV) or None)
        cache = AdaptersCache(self.controller.snapshot, ttl_s=CACHE_TTL_S)
        ctx = RolloutContext.from_plan(plan, rollout_client, deployment.session_url)
        # Failing requests are tolerated while a lost engine can be noticed (a collect times out) and restarted.
        grace_s = m.max_empty_wait_s + plan.executor.health_timeout_s
        self.rollout = MultiLoRARollout(ctx, cache, seed=plan.seed, unreachable_grace_s=grace_s)
        self.buffers = AdapterBuffers(plan.trainer.parallel.dp, plan.sync.max_weight_staleness)
        producer = GroupProducer(
            cache, self.buffers, self.rollout.next_prompt, self.rollout.generate_group, concurrency=2 * m.slots
        )
        self.sync = make_sync(plan, self.engines, slot_lora_name(0))
        self.tracker = self._tracker()
        producer.start()
        try:
            await self._loop()
        finally:
            await producer.stop()
            await self.rollout.aclose()
            await self.sync.close()
            self.tracker.close()
            self._plot_adapters()
            for client in [*self.engines, rollout_client, self.controller]:
                await client.aclose()
        return self.tracker.records

    def _tracker(self):
        """tracking.Tracker, with the iteration count it can expect: every plan adapter's steps, in global batches."""
        done = MetricsFile(self.run_dir / "metrics.jsonl").read() if self.resume else []
        self.iteration = done[-1]["step"] + 1 if done else 0
        plan = self.plan
        samples = sum(
            (a.num_step or plan.batch.num_steps) * a.rollout_batch_size * a.n_samples_per_prompt for a in plan.adapters
        )
        iterations = max(self.iteration + 1, -(-samples // plan.batch.global_batch_size))
        shown = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, num_steps=iterations))
        return Tracker(shown, self.run_dir, start_step=self.iteration)

    # ---- the loop -----------------------------------------------------------------------------------

    async def _loop(self) -> None:
        m = self.plan.multi_lora
        while True:
            snapshot = await self.controller.snapshot()
            if not snapshot.has_work:
                if not m.service_mode:
                    return
                await asyncio.sleep(m.idle_poll_s)
                continue
            await self._reconcile()
            try:
                await self._restart_dead_engines()
                sync_s = await self._update_weights()
            except (EngineUnavailable, EngineError, RuntimeError) as error:
                if not await self._restarted_after(error):
                    raise
                continue  # the next pass pushes every adapter to the new engine
            snapshot = await self.controller.snapshot()
            if not snapshot.sampleable:
                await asyncio.sleep(CACHE_TTL_S)
                continue
            self.tracker.phase(self.iteration, "rollout")
            started = time.perf_counter()
            try:
                batch = await collect_batch(
                    self.buffers, snapshot, target_samples=self.plan.batch.global_batch_size,
                    coalesce_wait_s=m.max_coalesce_wait_s, empty_wait_s=m.max_empty_wait_s,
                )  # fmt: skip
            except EmptyBatchTimeoutError as error:
                log.warning("%s; reconciling and trying again", error)
                continue
            collect_s = time.perf_counter() - started
            await self._train(snapshot, batch, {"batch/collect_seconds": collect_s, "sync/seconds": sync_s})
            self.iteration += 1

    async def _train(self, snapshot: RegistrySnapshot, batch, timings: dict[str, float]) -> None:
        rollout_id = f"{self.run_dir.name}-{self.iteration}"
        await self.controller.record_batch_adapters(rollout_id, batch.group_counts, batch.step_names)
        self.tracker.phase(self.iteration, "train")
        started = time.perf_counter()
        metrics = await asyncio.to_thread(self.trainer.train, batch.samples, batch.step_slots)
        train_s = time.perf_counter() - started
        stepped = await self.controller.mark_batch_trained(rollout_id)  # only now do steps count
        self.to_push |= set(stepped)
        self.events.write(self.iteration, "trained", step_names=stepped, groups=[
            [g.adapter, g.slot, g.slot_version, g.registration_id, g.index] for g in batch.groups
        ])  # fmt: skip
        steps = {name: (await self.controller.adapter_step(name)) for name in stepped}
        record = self._record(snapshot, batch, metrics, steps, {**timings, "train/seconds": train_s})
        self.tracker.step_done(self.iteration, record)
        for name in stepped:
            if self._checkpoint_due(steps[name]):
                self._checkpoint(self.loaded[name], steps[name])

    def _record(self, snapshot, batch, metrics, steps, timings) -> dict[str, Any]:
        samples = batch.samples
        record: dict[str, Any] = {
            "step": self.iteration,
            "reward/mean": sum(s.reward or 0.0 for s in samples) / len(samples),
            "batch/samples": len(samples),
            "rollout/tokens_per_s": self._token_rate(),
            **timings,
        }
        for name, groups in batch.group_counts.items():
            slot_metrics = metrics[snapshot.sampleable[name].slot]
            record[f"{name}/groups"] = groups
            record[f"{name}/reward/mean"] = slot_metrics["reward_mean"]
            record[f"{name}/train/loss"] = slot_metrics["loss"] / slot_metrics["samples"]
            for key in ("kl", "entropy", "clip_fraction", "grad_norm", "rollout_logprob_abs_diff"):
                if key in slot_metrics:
                    record[f"{name}/train/{key}"] = slot_metrics[key]
        for name, step in steps.items():
            record[f"{name}/step"] = step
        for (name, reason), count in self.buffers.dropped.items():
            record[f"{name}/dropped/{reason}"] = count
        for name, count in self.rollout.aborted.items():
            record[f"{name}/rollout/aborted"] = count
        for name, turns in _mean_by_adapter(samples, "turns").items():
            record[f"{name}/rollout/turns_mean"] = turns
        return record

    def _token_rate(self) -> float:
        """Tokens generated (all adapters) per second since the previous record."""
        now, tokens = time.perf_counter(), self.rollout.tokens_generated
        last_t, last_tokens = self._rate_mark
        self._rate_mark = (now, tokens)
        return 0.0 if last_t is None else (tokens - last_tokens) / max(now - last_t, 1e-9)

    # ---- reconcile and push (spec §4.7) -------------------------------------------------------------

    async def _reconcile(self) -> None:
        """Retire (RETIRING -> CLEANUP, with prefix aborts), clean up, then load what is new."""
        retired = await self.controller.retire_adapters()
        if retired:
            self.events.write(self.iteration, "retired", names=retired)
        snapshot = await self.controller.snapshot()
        for name in snapshot.cleanup:
            if name in self.loaded:
                self._clean_up(name)
            await self.controller.free_slot(name)
        wanted = {**snapshot.pending, **snapshot.active, **snapshot.retiring}
        for name in sorted(set(wanted) - set(self.loaded)):
            await self._load(wanted[name])

    async def _load(self, run: AdapterRun) -> None:
        saved = load_latest(Path(run.config.save))
        self.trainer.load_adapter(run.slot, adapter_plan(run), saved[0] if saved else None)
        if run.config.num_step is None:  # an epoch of its data file; a generated task: the plan's step count
            rows = self.rollout.dataset_rows(run) or self.plan.batch.num_steps * run.config.rollout_batch_size
            await self.controller.resolve_num_step(run.name, rows)
        if saved:
            meta = saved[1]
            await self.controller.set_adapter_step(run.name, meta["step"])
            self.rollout.start_cursor(run.name, meta["cursor"])
        self.loaded[run.name] = run
        self.to_push.add(run.name)
        self.events.write(
            self.iteration,
            "loaded",
            name=run.name,
            slot=run.slot,
            registration_id=run.registration_id,
            resumed_step=saved[1]["step"] if saved else None,
        )

    def _clean_up(self, name: str) -> None:
        """Final checkpoint (when checkpoints are on), then release the slot's adapter and optimizer."""
        run = self.loaded.pop(name)
        step = self.trainer.slots[run.slot].step  # the adapter's step: the trainer resumed it from the checkpoint
        save = Path(run.config.save)
        if self.plan.checkpoint.interval > 0 and step > 0 and step not in completed_steps(save):
            self._checkpoint(run, step)
        self.trainer.clear_adapter(run.slot)
        self.rollout.forget(name)
        self.to_push.discard(name)
        self.events.write(self.iteration, "cleaned_up", name=name, slot=run.slot)

    async def _restart_dead_engines(self) -> list[int]:
        """Engines that died come back (the executor's `engine_restarts` allowing) before the next push."""
        started = time.perf_counter()
        restarted = await asyncio.to_thread(self.executor.restart_dead_engines)
        if restarted:
            seconds = round(time.perf_counter() - started, 3)
            self.events.write(self.iteration, "engines_restarted", engines=restarted, seconds=seconds)
        return restarted

    async def _restarted_after(self, error: Exception) -> bool:
        """Whether `error` (a push or version check that failed) came from an engine that died: one is restarted
        within ENGINE_DEATH_WAIT_S (a killed engine is not reaped at once). Anything else is not ours to mend."""
        deadline = time.monotonic() + ENGINE_DEATH_WAIT_S
        while time.monotonic() < deadline:
            if await self._restart_dead_engines():
                log.warning("an engine died during the weight push (%r); it was restarted", error)
                return True
            await asyncio.sleep(0.2)
        return False

    async def _update_weights(self) -> float:
        """Push the adapters that stepped or are new; every loaded one when the engines are new (at the start,
        or an engine restarted and lost them)."""
        started = time.perf_counter()
        engines_new = await self._engines_new()
        if engines_new:
            await self.sync.reset()  # a new engine holds no adapter and is in no weight-update group
        names = set(self.loaded) if engines_new else self.to_push & set(self.loaded)
        for name in sorted(names, key=lambda n: self.loaded[n].slot):
            await self._push(self.loaded[name])
        bumped = sorted(self.to_push & names)
        if bumped:
            await self.controller.record_weight_update(bumped)
            self.events.write(self.iteration, "pushed", names=bumped)
        if engines_new:
            self.events.write(self.iteration, "pushed_all", names=sorted(names), engine_adapters=[
                sorted(card["id"] for card in (await engine.list_models())[1:]) for engine in self.engines
            ])  # fmt: skip
        self.to_push -= names
        return time.perf_counter() - started

    async def _push(self, run: AdapterRun) -> None:
        slot = run.slot
        self.pushes += 1
        await self.sync.push(self.trainer.adapter_state(slot), self.trainer.adapter_config(slot), self.pushes,
                             lora_name=slot_lora_name(slot))  # one weight-update group serves every slot

    async def _engines_new(self) -> bool:
        """An engine that does not report the last pushed weight version lost its adapters (or never had them)."""
        if not self.loaded:
            return False
        versions = await asyncio.gather(*(engine.weight_version() for engine in self.engines))
        return any(version != str(self.pushes) for version in versions)

    # ---- checkpoints --------------------------------------------------------------------------------

    def _checkpoint_due(self, step: int) -> bool:
        """Every `interval` steps of the adapter; its last step is saved when it is cleaned up."""
        interval = self.plan.checkpoint.interval
        return interval > 0 and step % interval == 0

    def _checkpoint(self, run: AdapterRun, step: int) -> None:
        meta = {"name": run.name, "cursor": self.rollout.cursors.get(run.name, 0)}
        save_checkpoint(
            Path(run.config.save),
            step,
            self.trainer.state_dict(run.slot),
            meta,
            keep_last=self.plan.checkpoint.keep_last,
        )

    def _plot_adapters(self) -> None:
        records = self.tracker.records
        if not (self.plan.logger.plots and records):
            return
        names = sorted(
            {
                key.removesuffix("/reward/mean")
                for r in records
                for key in r
                if key.endswith("/reward/mean") and key != "reward/mean"
            }
        )
        for name in names:
            plot_metrics(records, self.run_dir / f"metrics_{name}.png", prefix=f"{name}/")


def _mean_by_adapter(samples, key: str) -> dict[str, float]:
    """The mean of a sample metadata field per adapter, over the samples that carry it (agentic episodes)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        if key in sample.metadata:
            values.setdefault(sample.metadata["adapter"], []).append(float(sample.metadata[key]))
    return {name: sum(v) / len(v) for name, v in values.items()}
