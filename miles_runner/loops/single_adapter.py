"""The training loop (docs/system.md §7): rollout -> reward -> advantages -> train -> sync adapter -> log -> checkpoint.

`sync` schedule (train.py): each step generates with the weights of the last push. `async` schedule (train_async.py,
disaggregated only): step n+1 is generated while step n trains, so its samples are at least one weight version old. The
adapter is pushed after every `update_weights_interval` steps (train_async.py's `(rollout_id + 1) % interval`) and after
the last step, so the engines end on the adapter the run saves. The weight version is the number of steps trained, so a
batch lags the trainer by up to interval - 1 versions, plus one under the async schedule (plan.staleness_bound): every
step records the version that generated its rollout and the one it trained at, and a batch beyond the bound stops the
run. Every push is verified (weight_sync/verify.py): each engine reports the new version, and with
plan.weight_sync.verify every engine's logprobs of the push probe (weight_sync/probe.py) must match the trainer's, which
still holds exactly the pushed adapter, before it trains further. An engine that dies mid-run is restarted per
`executor.engine_restarts` (engine_restarts.py): the interrupted rollout or push runs again and each step is trained
once; with no restarts left the run ends naming the engine.

Read top to bottom: `SingleAdapterLoop.run` starts the deployment, `_train` builds the run's parts in one place (the
`RunParts` every step uses), and `_steps` is the step loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER, warn_fault_switches
from miles_runner.executors.local import Deployment
from miles_runner.executors.ray import make_executor
from miles_runner.loops.checkpoint import load_latest, save_checkpoint
from miles_runner.loops.engine_restarts import EngineRestarts
from miles_runner.loops.step_offload import StepOffload
from miles_runner.plan.model import Plan
from miles_runner.plugins.tasks import PromptStream
from miles_runner.procs.heap import freeze_startup_heap
from miles_runner.rollout.agentic import SessionClients, rollout_agentic
from miles_runner.rollout.context import RolloutContext, rollout_engines
from miles_runner.rollout.single_turn import rollout_single_turn
from miles_runner.session.samples import Sample
from miles_runner.sglang_client.client import EngineClient
from miles_runner.tracking.tracker import Tracker
from miles_runner.trainer.host import DriverTrainer, open_trainer
from miles_runner.trainer.interface import Trainer
from miles_runner.trainer.ranks import RemoteRanks
from miles_runner.weight_sync.adapter_sync import SyncReport
from miles_runner.weight_sync.probe import PushProbe, probe_token_ids
from miles_runner.weight_sync.sync import make_sync, share_trainer_adapter
from miles_runner.weight_sync.verify import SyncVerificationError

STARTUP_FILE = "startup.json"


class StaleSamplesError(RuntimeError):
    pass


def rollout_version(samples: list[Sample], default: int) -> int:
    """The oldest weight version any token of the batch was generated with (`default` when none says)."""
    return min(int(v) for s in samples for v in (s.weight_versions or [str(default)]))


def check_staleness(samples: list[Sample], version: int, max_staleness: int) -> int:
    """The batch's staleness at trainer version `version`; StaleSamplesError beyond `max_staleness`."""
    oldest = rollout_version(samples, version)
    if version - oldest > max_staleness:
        raise StaleSamplesError(
            f"samples from weight version {oldest} are {version - oldest} versions old at version {version}; the "
            f"plan allows {max_staleness} (weight_sync.update_weights_interval - 1, plus one for the async schedule)"
        )
    return version - oldest


@dataclass
class PendingRollout:
    """A rollout under way: its task, its prompts (to generate again if an engine dies under it) and the engine
    deaths recovered from when it started."""

    task: asyncio.Task
    prompts: list[Any]
    deaths_before: int


def push_due(done: int, total: int, interval: int) -> bool:
    """Whether the adapter is pushed after `done` steps: every `interval` steps, and after the last one."""
    return done % interval == 0 or done == total


@dataclass(frozen=True)
class RunParts:
    """What every step uses; built once, in `SingleAdapterLoop._train`."""

    trainer: Trainer
    ctx: RolloutContext
    sessions: SessionClients | None  # agentic rollouts: one connection pool to the session server for the whole run
    stream: PromptStream  # the prompts, with the data cursor a checkpoint keeps
    restarts: EngineRestarts  # pushes through the sync; restarts the engines that die under a rollout or a push
    probe: PushProbe | None  # plan.weight_sync.verify: every engine scores the probe after a push
    tracker: Tracker
    initial_adapter: dict[str, Any]  # the trainer's adapter before step 0 (or the checkpoint's on a resume)
    adapter_shared: bool  # the adapter's parameters live in the sync's shared memory: a push sends them as they are
    offload: StepOffload | None  # rollout or training offload: the engines and the trainer take turns


def builds_trainer_early(plan: Plan) -> bool:
    """A CPU plan's one trainer rank loads while the engines start: both are mostly imports and a model load, each on
    a core of its own (bench/single_turn_step.py times the start-up). Ranks in other processes need the deployment,
    and a GPU trainer waits, so that an engine sizes its memory with the GPU to itself. A model not on disk yet (a tiny
    model's first run) is built by the executor as the engines start: the trainer waits for it."""
    return plan.cluster.cpu_only and plan.trainer.parallel.world_size <= 1 and Path(plan.model_path).is_dir()


class SingleAdapterLoop:
    """One adapter trained on the plan's deployment: the sync or async schedule of docs/system.md §7."""

    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False) -> None:
        self.plan, self.run_dir, self.resume = plan, Path(run_dir), resume
        self.executor = make_executor(plan, self.run_dir)
        self.freeze_adapter = FREEZE_ROLLOUT_ADAPTER in warn_fault_switches()
        self.stamps: dict[str, float] = {}  # start-up milestones (epoch seconds): RUN_DIR/startup.json

    def run(self) -> list[dict[str, Any]]:
        """Start the deployment (a CPU trainer builds meanwhile), then train; returns the step records."""
        self._stamp("loop_started")
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-build") as pool:
                early = pool.submit(self._build_trainer, None) if builds_trainer_early(self.plan) else None
                with self.executor as deployment:
                    self._stamp("engines_ready")
                    return asyncio.run(self._train(deployment, early))
        finally:
            self._stamp("loop_ended")
            with contextlib.suppress(OSError):  # a figure for benches: never the reason a run fails
                (self.run_dir / STARTUP_FILE).write_text(json.dumps(self.stamps, indent=1))

    def _stamp(self, milestone: str) -> None:
        self.stamps.setdefault(milestone, time.time())

    def _build_trainer(self, remote_ranks: RemoteRanks | None) -> DriverTrainer:
        trainer = open_trainer(self.plan, self.run_dir, remote_ranks)  # ranks on other nodes: their agents start them
        self._stamp("trainer_built")
        return trainer

    async def _train(self, deployment: Deployment, early: Future[DriverTrainer] | None) -> list[dict[str, Any]]:
        """Build the run's parts, give the engines the trainer's adapter, train every step, save the adapter;
        everything is closed after, in reverse order."""
        plan, key = deployment.plan, deployment.api_key  # as it runs (its ports chosen); the key every server requires
        async with contextlib.AsyncExitStack() as stack:
            trainer = await asyncio.wrap_future(early) if early else self._build_trainer(deployment.remote_ranks)
            stack.callback(trainer.close)  # the other trainer ranks leave
            self._stamp("trainer_ready")
            engines = [await stack.enter_async_context(EngineClient(u, api_key=key)) for u in deployment.engine_urls]
            # Rollouts spread their groups over the engines.
            pool = await stack.enter_async_context(rollout_engines(plan, deployment.engine_urls, api_key=key))
            ctx = RolloutContext.from_plan(plan, pool, deployment.session_url, api_key=key)
            sessions = None
            if ctx.session_url:
                sessions = await stack.enter_async_context(SessionClients(str(ctx.session_url), api_key=key))
            stream, start = PromptStream(ctx.task), 0
            if self.resume and (saved := load_latest(self.run_dir)):
                state, meta = saved
                trainer.load_state_dict(state)
                stream.load_state_dict(meta["data"])
                start = meta["step"]
            tracker = Tracker(plan, self.run_dir, start_step=start)
            stack.callback(tracker.close)
            sync = make_sync(plan, engines, plan.adapters[0].lora_name, trainer_address=deployment.trainer_address)
            stack.push_async_callback(sync.close)
            restarts = EngineRestarts(self.executor, sync, self.run_dir, plan.executor.engine_restarts)
            probe = None
            if plan.weight_sync.verify:  # every engine scores the probe under the adapter it was just pushed
                probe = PushProbe(engines, probe_token_ids(plan.model_path), plan.weight_sync.max_logprob_gap)
            initial_adapter = trainer.adapter_state()
            shared = share_trainer_adapter(trainer, sync)
            offload = None
            if plan.weight_sync.offload_tags or plan.trainer.offload_train:
                offloaded_trainer = trainer if plan.trainer.offload_train else None
                offload = StepOffload(engines, plan.weight_sync.offload_tags, offloaded_trainer, self.run_dir)
            parts = RunParts(trainer, ctx, sessions, stream, restarts, probe, tracker, initial_adapter, shared, offload)
            freeze_startup_heap()  # the trainer, clients and imports: alive for the whole run
            self._stamp("rollout_ready")
            # The engines start from the trainer's adapter: the initial one, or on a resume the checkpoint's.
            await self._push(parts, initial_adapter, start, what=f"the push before step {start}")
            self._stamp("first_push_done")
            await self._steps(parts, start)
            if offload:  # the trainer's state back, and its scratch chunks gone
                await offload.onload_trainer(plan.batch.num_steps)
            trainer.save_adapter(self.run_dir / "adapter")
        return tracker.records

    async def _steps(self, parts: RunParts, start: int) -> None:
        """Steps `start` to the last: rollout -> train -> push when due -> record -> checkpoint when due. Under the
        async schedule the next step's rollout is generated while this one trains."""
        plan, total = self.plan, self.plan.batch.num_steps
        overlap = plan.rollout.schedule == "async"
        ahead: PendingRollout | None = None  # the next step's rollout, started early (async schedule)
        engine_version = start  # the weight version the engines hold: that of the last push
        step_started = time.perf_counter()  # a step's seconds run to its record from the previous one's
        for step in range(start, total):  # the trainer holds weight version `step` (steps trained so far)
            parts.tracker.phase(step, "rollout")
            samples, rollout_metrics = await self._rollout_result(parts, ahead or self._start_rollout(parts), step)
            staleness = check_staleness(samples, step, plan.staleness_bound)
            ahead = self._start_rollout(parts) if overlap and step + 1 < total else None
            due = push_due(step + 1, total, plan.weight_sync.update_weights_interval)
            parts.tracker.phase(step, "train")
            train_metrics, train_s, mine = await self._train_step(parts, step, samples, probe_due=due)
            sync_metrics: dict[str, float] = {}
            if due:
                if ahead is not None:
                    await asyncio.wait([ahead.task])  # docs/system.md §7: the update waits for the generation
                parts.tracker.phase(step, "sync")
                sync_metrics = await self._sync(parts, step + 1, mine)
                engine_version = step + 1
            elif parts.offload:
                await parts.offload.onload_rest(step)
            if parts.offload:
                sync_metrics.update(parts.offload.take_figures())
            record = step_record(step, samples, rollout_metrics, train_metrics, train_s, staleness)
            record.update(
                {"weight_version": engine_version, **sync_metrics, "step/seconds": time.perf_counter() - step_started}
            )
            step_started = time.perf_counter()
            parts.tracker.step_done(step, record)
            self._stamp("first_step_done")
            if self._checkpoint_due(step + 1):
                parts.tracker.phase(step, "checkpoint")
                self._checkpoint(parts.trainer, parts.stream, step + 1, taken_ahead=ahead is not None)
                if parts.offload:  # the save needed the trainer's state: it leaves again until the next train
                    await parts.offload.offload_trainer(step)

    async def _train_step(
        self, parts: RunParts, step: int, samples: list[Sample], *, probe_due: bool
    ) -> tuple[dict[str, float], float, list[float] | None]:
        """Train on the rollout, with the step's offload calls around it (docs/system.md §7): the engines release,
        the trainer comes back, trains, and leaves again before the engines take their weights back. Returns the
        metrics, the seconds, and the trainer's probe logprobs when it left (the push probe compares them)."""
        if parts.offload:
            await parts.offload.release(step)
            await parts.offload.onload_trainer(step)
        started = time.perf_counter()
        metrics = await asyncio.to_thread(parts.trainer.train, samples)
        train_s = time.perf_counter() - started
        mine = None
        if parts.offload and parts.offload.trainer is not None:
            if probe_due and parts.probe is not None:
                mine = await asyncio.to_thread(parts.trainer.probe_log_probs, parts.probe.token_ids)
            await parts.offload.offload_trainer(step)
        if parts.offload:
            await parts.offload.onload_weights(step)
        return metrics, train_s, mine

    # ---- rollouts ----

    def _start_rollout(self, parts: RunParts) -> PendingRollout:
        """Take the prompts now (the data cursor moves here, not when the task first runs), generate later."""
        return self._generate(parts, parts.stream.next_batch(self.plan.batch.rollout_batch_size))

    def _generate(self, parts: RunParts, prompts: list[Any]) -> PendingRollout:
        return PendingRollout(asyncio.create_task(self._rollout(parts, prompts)), prompts, parts.restarts.count)

    async def _rollout_result(
        self, parts: RunParts, pending: PendingRollout, step: int
    ) -> tuple[list[Sample], dict[str, float]]:
        """The rollout's samples; generated again from the same prompts while an engine that died under it could be
        restarted (executor.engine_restarts)."""
        while True:
            try:
                return await pending.task
            except Exception as error:
                if not await parts.restarts.recovered_rollout(error, step, pending.deaths_before):
                    raise
            pending = self._generate(parts, pending.prompts)

    async def _rollout(self, parts: RunParts, prompts: list[Any]) -> tuple[list[Sample], dict[str, float]]:
        started = time.perf_counter()
        if parts.sessions is not None:
            samples = await rollout_agentic(parts.ctx, prompts, parts.sessions)
        else:
            samples = await rollout_single_turn(parts.ctx, prompts)
        seconds = time.perf_counter() - started
        tokens = sum(s.response_length for s in samples)
        return samples, {
            "rollout/seconds": seconds,
            "rollout/tokens": tokens,
            "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
        }

    # ---- pushes ----

    async def _sync(self, parts: RunParts, version: int, mine: list[float] | None) -> dict[str, float]:
        # Under the fault switch the engines get a new version of the *initial* adapter: the protocol and the
        # versions run as usual, only the trained weights never reach the rollouts.
        if self.freeze_adapter:
            tensors = parts.initial_adapter
        else:  # the parameters themselves where they live in the sync's shared memory: no copy before the engine's
            tensors = (parts.trainer.adapter_views() if parts.adapter_shared else None) or parts.trainer.adapter_state()
        what = f"the push after step {version - 1}"
        report, probed = await self._push(parts, tensors, version, what=what, offloaded=True, mine=mine)
        return {
            "sync/seconds": report.seconds,
            "sync/verify_seconds": report.verify_seconds,
            "sync/shared_memory": float(report.shared_memory),
            **probed,
        }

    async def _push(
        self,
        parts: RunParts,
        tensors: Mapping[str, Any],
        version: int,
        *,
        what: str,
        offloaded: bool = False,
        mine: list[float] | None = None,
    ) -> tuple[SyncReport, dict[str, float]]:
        """Push, then probe every engine while the trainer holds exactly the pushed adapter
        (plan.weight_sync.verify). `offloaded` (a step's push): under offload the engines' KV cache comes back
        between the two (a probe is a generation: it needs it). `mine`: the trainer's probe logprobs, taken before
        it was offloaded."""
        try:
            report = await parts.restarts.push(tensors, parts.trainer.adapter_config(), version, step=version)
        except SyncVerificationError as error:
            raise SyncVerificationError(f"{what}: {error}") from None
        if offloaded and parts.offload:
            parts.offload.update(version - 1, version, report.seconds)
            await parts.offload.onload_rest(version - 1)
        if parts.probe is None:
            return report, {}
        started = time.perf_counter()
        if mine is None:
            mine = await asyncio.to_thread(parts.trainer.probe_log_probs, parts.probe.token_ids)
        probed = await parts.probe.check(mine, self.plan.adapters[0].lora_name, what=what)
        return report, {"verify/logprob_gap": max(probed.gaps), "verify/seconds": time.perf_counter() - started}

    # ---- checkpoints ----

    def _checkpoint_due(self, done: int) -> bool:
        interval = self.plan.checkpoint.interval
        return done == self.plan.batch.num_steps or (interval > 0 and done % interval == 0)

    def _checkpoint(self, trainer: Trainer, stream: PromptStream, done: int, *, taken_ahead: bool) -> None:
        # An overlapped rollout has already taken the next batch's prompts: resume must take them again.
        cursor = stream.state_dict()
        if taken_ahead:
            cursor = {**cursor, "cursor": cursor["cursor"] - self.plan.batch.rollout_batch_size}
        save_checkpoint(
            self.run_dir, done, trainer.state_dict(), {"data": cursor}, keep_last=self.plan.checkpoint.keep_last
        )


def step_record(step, samples, rollout_metrics, train_metrics, train_s, staleness: int) -> dict[str, Any]:
    """The step's metrics: the rollout generated at `rollout/weight_version`, trained at `train/weight_version`
    (= step), `train/weight_staleness` apart."""
    rewards = [s.reward or 0.0 for s in samples]
    record: dict[str, Any] = {
        "step": step,
        "reward/mean": sum(rewards) / len(rewards),
        **rollout_metrics,
        "rollout/weight_version": step - staleness,
    }
    record.update({f"train/{k}": v for k, v in train_metrics.items() if k not in ("step", "reward_mean")})
    record.update({"train/seconds": train_s, "train/weight_version": step, "train/weight_staleness": staleness})
    record["train/logprob_abs_diff"] = train_metrics.get("rollout_logprob_abs_diff")
    return record
