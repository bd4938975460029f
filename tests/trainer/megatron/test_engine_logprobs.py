"""The Megatron trainer against a real embedded engine: its log-probs of the engine's own rollouts (the runner's
single-turn rollout of the tiny_r3_session plan with `trainer=megatron lora_mode=raw`) are the engine's within
1e-4, on the base model and with a non-zero adapter loaded into both (a peft folder: the engine through its
load_lora_adapter API, the trainer through adapters.init_path); and routing replay (R3) leaves a gap no larger
than the trainer's own routing, and a smaller one once the routers moved (as tests/trainer/
test_routing_replay_engine.py shows for the FSDP trainer, on the same measurement: miles_testkit/routing_gap.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from miles_runner.plan.model import Plan
from miles_runner.session.samples import Sample
from miles_runner.sglang_client.client import EngineClient
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.policy_trainer import TrainerSettings
from miles_testkit.routing_gap import engine_samples, logprob_gap, measure_gaps, r3_engine, r3_plan

from .fused_adapter import save_fused_adapter

pytestmark = pytest.mark.integration

PROMPTS = 2
TOLERANCE = 1e-4
MOVED = 0.1  # std of the noise added to every gate weight (they are initialised with std 0.1)
ADAPTER = "fused"


def megatron_trainer(model_path: str, settings: TrainerSettings) -> MegatronTrainer:
    return MegatronTrainer(model_path, settings, parallel.Layout())


@pytest.fixture(scope="module")
def plan() -> Plan:
    return r3_plan("trainer=megatron", "lora_mode=raw")


@pytest.fixture(scope="module")
def adapter_dir(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = plan.adapters[0]
    return save_fused_adapter(
        plan.model_path, tmp_path_factory.mktemp("fused") / "adapter", rank=spec.rank, alpha=spec.alpha
    )


async def load_adapter(url: str, folder: Path) -> None:
    async with EngineClient(url) as client:
        await client.load_lora_adapter(ADAPTER, str(folder))


@pytest.fixture(scope="module")
def rollouts(plan: Plan, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Sample]]:
    """The engine's samples of the base model and of the adapter (routed experts on, LoRA on)."""
    lora = ("--enable-lora", "--max-lora-rank", str(plan.adapters[0].rank))
    with r3_engine(plan, tmp_path_factory.mktemp("engine"), lora) as url:
        asyncio.run(load_adapter(url, adapter_dir))
        return {"base": engine_samples(plan, url, PROMPTS), "adapter": engine_samples(plan, url, PROMPTS, ADAPTER)}


@pytest.fixture(scope="module")
def gaps(plan: Plan, rollouts: dict[str, list[Sample]]) -> dict[float, dict]:
    """The plan's Megatron trainer with and without replay (the initial, identity adapter) on the base rollouts."""
    return measure_gaps(plan, rollouts["base"], (0.0, MOVED), factory=megatron_trainer)


def test_base_model_log_probs_are_the_engines(gaps):
    print(f"base model |trainer - engine| log-prob: {gaps[0.0]}")
    assert gaps[0.0]["own routing"]["max"] < TOLERANCE
    assert gaps[0.0]["replay"]["max"] < TOLERANCE


def test_adapter_log_probs_are_the_engines(plan, adapter_dir, rollouts):
    settings = TrainerSettings.from_plan(plan)
    adapter = dataclasses.replace(settings.adapter, init_path=str(adapter_dir))
    settings = dataclasses.replace(settings, routing_replay=False, adapter=adapter)
    trainer = megatron_trainer(plan.model_path, settings)
    gap = logprob_gap(trainer, rollouts["adapter"])
    base = trainer.compute_log_probs(rollouts["adapter"], adapter=False)
    base_gap = max(
        abs(a - b)
        for ours, s in zip(base, rollouts["adapter"], strict=True)
        for a, b in zip(ours, s.rollout_log_probs, strict=True)
    )
    print(f"adapter |trainer - engine| log-prob: {gap}; the base model's max {base_gap:.3g}")
    assert gap["max"] < TOLERANCE
    assert base_gap > 100 * TOLERANCE, "the engine's rollouts did not use the adapter: nothing was compared"


def test_the_gap_with_replay_is_no_larger_when_the_routers_are_the_rollouts(gaps):
    assert gaps[0.0]["replay"]["mean"] <= gaps[0.0]["own routing"]["mean"]


def test_the_gap_with_replay_is_smaller_once_the_routers_moved(gaps):
    print(f"routers moved: {gaps[MOVED]}")
    assert gaps[MOVED]["replay"]["mean"] < gaps[MOVED]["own routing"]["mean"]
    assert gaps[MOVED]["own routing"]["mean"] > gaps[0.0]["own routing"]["mean"]  # the move mattered
