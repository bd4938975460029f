"""The training loop (spec §7): rollout -> reward -> advantages -> train -> sync adapter -> log -> checkpoint.

`sync` driver (train.py): each step generates with the weights just trained, so samples are on-policy.
`async` driver (train_async.py, disaggregated only): step n+1 is generated while step n trains, so its samples
are one weight version old; the staleness check (plan.sync.max_weight_staleness) is what allows that.
Every sample carries the weight_version that generated it; older than the allowed staleness is rejected.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER, warn_fault_switches
from miles_runner.engine.client import EngineClient
from miles_runner.executors.ray import make_executor
from miles_runner.loops.checkpoint import load_latest, save_checkpoint
from miles_runner.lora.sync import make_sync
from miles_runner.plan.model import Plan
from miles_runner.plugins.tasks import PromptStream
from miles_runner.rollout.agentic import rollout_agentic
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import rollout_single_turn
from miles_runner.session.samples import Sample
from miles_runner.tracking.tracker import Tracker
from miles_runner.trainer.ranks import make_trainer


class StaleSamplesError(RuntimeError):
    pass


def check_staleness(samples: list[Sample], version: int, max_staleness: int) -> None:
    oldest = min(int(v) for s in samples for v in (s.weight_versions or [str(version)]))
    if version - oldest > max_staleness:
        raise StaleSamplesError(
            f"samples from weight version {oldest} are {version - oldest} versions old at version {version}; "
            f"rollout.max_weight_staleness={max_staleness}"
        )


class SingleAdapterLoop:
    """One adapter trained on the plan's deployment: the sync or async driver of spec §7."""

    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False):
        self.plan, self.run_dir, self.resume = plan, Path(run_dir), resume
        self.freeze_adapter = FREEZE_ROLLOUT_ADAPTER in warn_fault_switches()

    def run(self) -> list[dict[str, Any]]:
        with make_executor(self.plan, self.run_dir) as deployment:
            return asyncio.run(self._loop(deployment))

    async def _loop(self, deployment) -> list[dict[str, Any]]:
        trainer = make_trainer(self.plan, self.run_dir)
        try:
            return await self._run_with(trainer, deployment)
        finally:
            trainer.close()  # the other trainer ranks leave

    async def _run_with(self, trainer, deployment) -> list[dict[str, Any]]:
        plan = self.plan
        engines = [EngineClient(url) for url in deployment.engine_urls]
        rollout_client = EngineClient(deployment.rollout_url)
        ctx = RolloutContext.from_plan(plan, rollout_client, deployment.session_url)
        stream = PromptStream(ctx.task)
        start = 0
        if self.resume and (saved := load_latest(self.run_dir)):
            state, meta = saved
            trainer.load_state_dict(state)
            stream.load_state_dict(meta["data"])
            start = meta["step"]
        self.tracker = Tracker(plan, self.run_dir, start_step=start)
        sync = make_sync(plan, engines, plan.adapters[0].lora_name)
        self.initial_adapter = trainer.adapter_state()
        try:
            await sync.push(self.initial_adapter, trainer.adapter_config(), start)
            await self._steps(trainer, sync, ctx, stream, start)
            trainer.save_adapter(self.run_dir / "adapter")
        finally:
            await sync.close()
            self.tracker.close()
            for client in [*engines, rollout_client]:
                await client.aclose()
        return self.tracker.records

    async def _steps(self, trainer, sync, ctx, stream, start: int) -> None:
        plan, total = self.plan, self.plan.batch.num_steps
        overlap = plan.sync.driver == "async"
        pending = self._start_rollout(ctx, stream) if start < total else None
        for step in range(start, total):
            self.tracker.phase(step, "rollout")
            samples, rollout_metrics = await pending
            pending = None
            check_staleness(samples, step, plan.sync.max_weight_staleness)
            more = step + 1 < total
            if overlap and more:  # generate the next batch with the current weights while this one trains
                pending = self._start_rollout(ctx, stream)
            self.tracker.phase(step, "train")
            started = time.perf_counter()
            train_metrics = await asyncio.to_thread(trainer.train, samples)
            train_s = time.perf_counter() - started
            if pending is not None:
                await asyncio.wait([pending])  # spec: the update waits for the in-flight generation
            self.tracker.phase(step, "sync")
            report = await self._sync(trainer, sync, step + 1)
            self.tracker.step_done(step, step_record(step, samples, rollout_metrics, train_metrics, train_s, report))
            if self._checkpoint_due(step + 1):
                self.tracker.phase(step, "checkpoint")
                self._checkpoint(trainer, stream, step + 1, taken_ahead=pending is not None)
            if not overlap and more:
                pending = self._start_rollout(ctx, stream)

    def _start_rollout(self, ctx, stream) -> asyncio.Task:
        """Take the prompts now (the data cursor moves here, not when the task first runs), generate later."""
        prompts = stream.next_batch(self.plan.batch.rollout_batch_size)
        return asyncio.create_task(self._rollout(ctx, prompts))

    async def _rollout(self, ctx, prompts) -> tuple[list[Sample], dict[str, float]]:
        started = time.perf_counter()
        run = rollout_agentic if ctx.session_url else rollout_single_turn
        samples = await run(ctx, prompts)
        seconds = time.perf_counter() - started
        tokens = sum(s.response_length for s in samples)
        return samples, {"rollout/seconds": seconds, "rollout/tokens": tokens,
                         "rollout/tokens_per_s": tokens / max(seconds, 1e-9)}

    async def _sync(self, trainer, sync, version: int):
        # Under the fault switch the engines get a new version of the *initial* adapter: the protocol and the
        # versions run as usual, only the trained weights never reach the rollouts.
        tensors = self.initial_adapter if self.freeze_adapter else trainer.adapter_state()
        return await sync.push(tensors, trainer.adapter_config(), version)

    def _checkpoint_due(self, done: int) -> bool:
        interval = self.plan.checkpoint.interval
        return done == self.plan.batch.num_steps or (interval > 0 and done % interval == 0)

    def _checkpoint(self, trainer, stream, done: int, *, taken_ahead: bool) -> None:
        # An overlapped rollout has already taken the next batch's prompts: resume must take them again.
        cursor = stream.state_dict()
        if taken_ahead:
            cursor = {**cursor, "cursor": cursor["cursor"] - self.plan.batch.rollout_batch_size}
        save_checkpoint(self.run_dir, done, trainer.state_dict(), {"data": cursor},
                        keep_last=self.plan.checkpoint.keep_last)


def step_record(step, samples, rollout_metrics, train_metrics, train_s, report) -> dict[str, Any]:
    rewards = [s.reward or 0.0 for s in samples]
    oldest = min(int(v) for s in samples for v in (s.weight_versions or [str(step)]))
    record: dict[str, Any] = {"step": step, "reward/mean": sum(rewards) / len(rewards), **rollout_metrics,
                              "rollout/staleness": step - oldest}
    record.update({f"train/{k}": v for k, v in train_metrics.items() if k not in ("step", "reward_mean")})
    record["train/seconds"] = train_s
    record["train/logprob_abs_diff"] = train_metrics.get("rollout_logprob_abs_diff")
    record["weight_version"] = report.version
    record["sync/seconds"] = report.seconds
    return record


