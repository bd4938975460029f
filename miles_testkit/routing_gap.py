"""The trainer/engine log-prob gap with and without routing replay (R3), on the tiny MoE and the embedded engine.

Shared by tests/trainer/test_routing_replay_engine.py (which asserts the inequality) and
bench/routing_replay_gap.py (which reports the figures). Rollouts are the runner's own single-turn rollout
(`/generate` with `return_routed_experts`) against a real embedded engine on loopback; the trainer is the FSDP
trainer of the `tiny_r3_session` plan, once with replay and once routing on its own. "Routers moved" adds the same
Gaussian noise to both trainers' gate weights after the rollout: what an update between rollout and training does
to routing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from miles_runner.config.compose import compose
from miles_runner.engine.workers import WorkerPool
from miles_runner.models.moe_routing import moe_routers
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import rollout_single_turn
from miles_runner.session.samples import Sample
from miles_runner.trainer.fsdp import FSDPTrainer, TrainerSettings
from miles_runner.trainer.logprobs import pack_samples, token_log_probs
from miles_runner.trainer.routing_replay import ReplayStats
from miles_testkit.launch import start_engine

RECIPE = "tiny_r3_session"


def r3_plan(*overrides: str) -> Plan:
    return compile_plan(compose([f"+recipe={RECIPE}", *overrides]))


@contextmanager
def r3_engine(plan: Plan, log_dir: Path) -> Iterator[str]:
    """The embedded engine on the plan's model with routed experts on (base model, no adapter); yields its URL."""
    port = free_port()
    argv = [sys.executable, "-m", "miles_runner.embedded_engine", "--model-path", plan.model_path, "--host", LOOPBACK,
            "--port", str(port), "--random-seed", str(plan.seed), "--enable-return-routed-experts"]  # fmt: skip
    engine = start_engine(argv, port=port, log_path=Path(log_dir) / "engine.log", timeout_s=180)
    try:
        yield f"http://{LOOPBACK}:{port}"
    finally:
        engine.stop()


def engine_samples(plan: Plan, engine_url: str, prompts: int) -> list[Sample]:
    """`prompts` x n_samples_per_prompt samples from the runner's single-turn rollout, with the engine's rows."""

    async def run() -> list[Sample]:
        async with WorkerPool.for_deployment(None, [engine_url], timeout_s=300) as workers:
            ctx = dataclasses.replace(RolloutContext.from_plan(plan, workers, None), lora_name=None)
            return await rollout_single_turn(ctx, [ctx.task.prompt(i) for i in range(prompts)])

    return asyncio.run(run())


def trainers(plan: Plan) -> dict[str, FSDPTrainer]:
    """The plan's trainer with routing replay, and the same trainer routing on its own."""
    settings = TrainerSettings.from_plan(plan)
    return {
        "replay": FSDPTrainer(plan.model_path, settings),
        "own routing": FSDPTrainer(plan.model_path, dataclasses.replace(settings, routing_replay=False)),
    }


def move_routers(model: torch.nn.Module, scale: float, seed: int = 1) -> None:
    """What an update between rollout and training does to routing: Gaussian noise on every gate weight."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, router in moe_routers(model):
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=generator))


def logprob_gap(trainer: FSDPTrainer, samples: list[Sample]) -> dict[str, float]:
    """Mean and max |trainer - engine| log-prob over every response token of the samples."""
    gaps = [
        abs(mine - engine)
        for ours, sample in zip(trainer.compute_log_probs(samples), samples, strict=True)
        for mine, engine in zip(ours, sample.rollout_log_probs, strict=True)
    ]
    return {"mean": sum(gaps) / len(gaps), "max": max(gaps)}


def replay_diff_frac(trainer: FSDPTrainer, samples: list[Sample]) -> float:
    """The share of replayed tokens the trainer's own routers would send to other experts (any layer)."""
    stats = ReplayStats()
    with torch.no_grad():
        token_log_probs(trainer.model, pack_samples(samples, trainer.pad_id, trainer.routing), replay_stats=stats)
    return stats.diff_frac


def measure(ours: dict[str, FSDPTrainer], samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Each trainer's gap, and (under "replay") the share of tokens whose replayed routing is not its own."""
    measured = {name: logprob_gap(trainer, samples) for name, trainer in ours.items()}
    measured["replay"]["diff_frac"] = replay_diff_frac(ours["replay"], samples)
    return measured


def measure_gaps(plan: Plan, samples: list[Sample], router_scales: tuple[float, ...]) -> dict[float, dict]:
    """Per router move (0: as at rollout): {scale: measure(...)}, on fresh trainers; the moves accumulate in the
    order given."""
    measured = {}
    ours = trainers(plan)
    moved = 0.0
    for scale in router_scales:
        for trainer in ours.values():
            move_routers(trainer.model, scale - moved)
        moved = scale
        measured[scale] = measure(ours, samples)
    return measured
