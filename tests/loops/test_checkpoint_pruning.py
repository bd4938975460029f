"""Checkpoints are pruned to the plan's checkpoint.keep_last: the single-adapter loop's run checkpoints, and each
multi-LoRA adapter's own, saved through the loops' checkpoint steps with real trainers."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.loops.checkpoint import completed_steps
from miles_runner.loops.multi_lora.checkpoints import AdapterCheckpoints
from miles_runner.loops.single_adapter import SingleAdapterLoop
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.client import ControllerClient
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.plan.compile import compile_plan
from miles_runner.plugins.lookup import make_task
from miles_runner.plugins.tasks import PromptStream
from miles_runner.rollout.context import RolloutContext, rollout_engines
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer
from miles_runner.trainer.policy_trainer import TrainerSettings
from tests.multi_lora.helpers import run

pytestmark = pytest.mark.integration

SAVES = 4
TINY = "model.path=tiny:tiny-moe"  # the plain tiny model: built here, and its tokenizer is the rollout's


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_tiny_model("tiny-moe"))


@pytest.mark.parametrize("keep_last", [1, 3])
def test_the_single_adapter_loop_keeps_the_last_keep_last_checkpoints(tmp_path, model_path, keep_last):
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic", f"checkpoint.keep_last={keep_last}"]))
    loop = SingleAdapterLoop(plan, tmp_path)
    trainer = FSDPTrainer(model_path, TrainerSettings.from_plan(plan))
    stream = PromptStream(make_task(plan.rollout.task, plan.seed, plan.rollout.data))
    for done in range(1, SAVES + 1):
        loop._checkpoint(trainer, stream, done, taken_ahead=False)
    assert completed_steps(tmp_path) == list(range(SAVES - keep_last + 1, SAVES + 1))


@pytest.mark.parametrize("keep_last", [1, 3])
async def test_each_multi_lora_adapter_keeps_its_last_keep_last_checkpoints(tmp_path, model_path, keep_last):
    overrides = ["+recipe=tiny_multi_lora", TINY, f"checkpoint.keep_last={keep_last}", "adapters.api_port=8068"]
    plan = compile_plan(compose(overrides))  # a controller URL to name (no request is sent)
    trainer = PeftMultiLoRATrainer(model_path, MultiLoRASettings.from_plan(plan))
    trainer.load_adapter(0, plan.adapters[0])
    async with rollout_engines(plan, []) as workers, ControllerClient(plan.multi_lora.launch.url) as controller:
        ctx = RolloutContext.from_plan(plan, workers, None)  # no request is sent
        rollout = MultiLoRARollout(ctx, AdaptersCache(_no_adapters), seed=plan.seed)
        checkpoints = AdapterCheckpoints(plan.checkpoint, trainer, rollout, controller)  # as the loop builds them
        adapter = run(plan.adapters[0].name, 0, save=str(tmp_path / "adapter"))
        for step in range(1, SAVES + 1):
            checkpoints.save(adapter, step)
    assert completed_steps(Path(adapter.config.save)) == list(range(SAVES - keep_last + 1, SAVES + 1))


async def _no_adapters() -> RegistrySnapshot:
    return RegistrySnapshot()
