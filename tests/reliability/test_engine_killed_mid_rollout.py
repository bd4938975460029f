"""An engine SIGKILLed mid-rollout in a single-adapter run, on CPU with the real loop, engine and trainer:

- `executor.engine_restarts=0`: the run fails naming the engine, no process of the run is left (each process and
  its process group is gone, the engine's port is free), and the last checkpoint on disk is the one saved before
  the kill, byte for byte, and loads;
- `executor.engine_restarts=1`: the engine is restarted, given the adapter of the last push, the interrupted
  rollout is generated again from the same prompts, and the run finishes with every step trained exactly once.

The loop is the real SingleAdapterLoop; the subclass only injects the fault: it kills the engine's process group
once the engine reports requests of the chosen rollout running (so the rollout is cut, not merely followed).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from miles_runner.core.errors import ComponentFailure
from miles_runner.loops.checkpoint import checkpoint_dir, completed_steps, load_latest
from miles_runner.loops.engine_restarts import ENGINE_EVENTS_FILE
from miles_runner.loops.single_adapter import SingleAdapterLoop
from miles_runner.plan.model import Plan
from miles_runner.plan.record import read_plan, read_ports
from miles_runner.procs.ports import port_is_free
from miles_runner.sglang_client.client import EngineClient
from tests.loops.recipe_runs import recorded_run, records

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

STEPS = 3
KILLED_ROLLOUT = 1  # the rollout of step 1: checkpoint step_1 is on disk by then
# The plain (not format pre-trained) tiny model: its answers seldom end before max_response_len, so the cut rollout
# runs 64 decode steps. The format pre-trained one answers in a few tokens: a whole rollout could start and end
# between two polls of the engine's running requests.
BASE = (
    "+recipe=tiny_lora_agentic",
    "model.path=tiny:tiny-moe",
    "session=off",
    "rollout.task=arith",
    "rollout.reward=exact_match",
    "rollout.max_turns=1",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_response_len=64",
    f"algorithm.num_steps={STEPS}",
    "checkpoint.interval=1",
    "logger=none",
)


class KillEngineMidRollout(SingleAdapterLoop):
    """The real loop; SIGKILLs engine 0 while rollout number KILLED_ROLLOUT has requests running on it, after noting
    the newest checkpoint's bytes and the pids of every process of the run."""

    def __init__(self, plan: Plan, run_dir: Path) -> None:
        super().__init__(plan, run_dir)
        self.rollouts = 0
        self.killed = False
        self.checkpoint_before: dict[str, str] = {}
        self.pids: set[int] = set()
        self.trained: list[int] = []  # the number of samples of each batch the trainer stepped on

    async def _rollout(self, parts, prompts):
        index, self.rollouts = self.rollouts, self.rollouts + 1
        rollout = asyncio.create_task(super()._rollout(parts, prompts))
        if index == KILLED_ROLLOUT:
            await self._kill_when_running(rollout, parts.ctx.plan.engines[0].launch.url)
        return await rollout

    async def _kill_when_running(self, rollout: asyncio.Task, engine_url: str) -> None:
        engine = self.executor.engines[0]
        async with EngineClient(engine_url) as client:
            while not rollout.done() and not (await client.server_info())["internal_states"][0]["num_running_reqs"]:
                await asyncio.sleep(0.005)
        assert not rollout.done(), "the rollout ended before the engine was seen running it"
        self.checkpoint_before = checkpoint_bytes(self.run_dir)
        self.pids = {p.pid for p in self.executor.group.processes if p.pid}
        os.killpg(engine.pid, signal.SIGKILL)
        self.killed = True

    def _build_trainer(self, remote_ranks):
        trainer = super()._build_trainer(remote_ranks)
        train = trainer.train

        def counted(samples, *args: Any, **kwargs: Any):
            self.trained.append(len(samples))
            return train(samples, *args, **kwargs)

        trainer.train = counted
        return trainer


def checkpoint_bytes(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of the newest checkpoint, by path under the checkpoints folder."""
    newest = checkpoint_dir(run_dir) / f"step_{completed_steps(run_dir)[-1]}"
    return {
        str(f.relative_to(checkpoint_dir(run_dir))): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(newest.rglob("*"))
        if f.is_file()
    }


def gone(pid: int) -> bool:
    """Neither the process nor any member of the process group it led is left."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return not Path(f"/proc/{pid}").exists()
    return False


def test_without_restarts_the_run_fails_naming_the_engine_stops_everything_and_keeps_its_checkpoint(tmp_path):
    run_dir = recorded_run(tmp_path, BASE, "executor.engine_restarts=0")
    plan = read_plan(run_dir / "plan.yaml")
    loop = KillEngineMidRollout(plan, run_dir)

    with pytest.raises(ComponentFailure, match=r"engine0") as failure:
        loop.run()

    assert loop.killed and "-9" in str(failure.value), failure.value
    assert loop.pids and all(gone(pid) for pid in loop.pids)
    assert port_is_free("127.0.0.1", read_ports(run_dir)["engine0"])  # the port it was started on
    assert completed_steps(run_dir)[-1] == KILLED_ROLLOUT
    assert checkpoint_bytes(run_dir) == loop.checkpoint_before
    state, meta = load_latest(run_dir)
    assert meta["step"] == KILLED_ROLLOUT and state
    assert [r["step"] for r in records(run_dir)] == list(range(KILLED_ROLLOUT))


def test_with_a_restart_the_run_finishes_with_every_step_trained_once(tmp_path):
    run_dir = recorded_run(tmp_path, BASE, "executor.engine_restarts=1")
    plan = read_plan(run_dir / "plan.yaml")
    loop = KillEngineMidRollout(plan, run_dir)

    loop.run()

    assert loop.killed
    events = [json.loads(line) for line in (run_dir / ENGINE_EVENTS_FILE).read_text().splitlines()]
    assert [(e["event"], e["engines"]) for e in events] == [("engines_restarted", [0])]
    steps = records(run_dir)
    assert [r["step"] for r in steps] == list(range(STEPS))
    assert loop.trained == [plan.batch.rollout_batch_size * plan.batch.n_samples_per_prompt] * STEPS
    assert loop.rollouts == STEPS + 1  # the cut rollout was generated again, once
    assert steps[-1]["weight_version"] == STEPS  # the restarted engine got every later push
    assert all(gone(p.pid) for p in loop.executor.group.processes if p.pid)
