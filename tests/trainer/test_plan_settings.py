"""The trainers run with the plan's settings, read through TrainerSettings.from_plan and
MultiLoRASettings.from_plan: the run's seed, the adapter's dropout, the optimizer's hyperparameters, gradient
clipping, and the std normalisation of the advantages."""

from __future__ import annotations

import pytest
import torch

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.session.samples import Sample
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer
from miles_runner.trainer.policy_trainer import TrainerSettings

from .test_fsdp import BAD, GOOD, group

pytestmark = pytest.mark.integration

# One prompt of two samples per optimizer step, as the groups below are.
ONE_GROUP = ("rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=2")


def plan_of(*overrides: str) -> Plan:
    return compile_plan(compose(["+recipe=tiny_lora_agentic", *ONE_GROUP, *overrides]))


def multi_plan_of(*overrides: str) -> Plan:
    return compile_plan(compose(["+recipe=tiny_multi_lora", *overrides]))


def fsdp_trainer(model_path: str, *overrides: str) -> FSDPTrainer:
    return FSDPTrainer(model_path, TrainerSettings.from_plan(plan_of(*overrides)))


def multi_trainer(model_path: str, *overrides: str) -> PeftMultiLoRATrainer:
    """The multi-LoRA trainer of a multi-LoRA plan, its first adapter loaded in slot 0."""
    plan = multi_plan_of(*overrides)
    trainer = PeftMultiLoRATrainer(model_path, MultiLoRASettings.from_plan(plan))
    trainer.load_adapter(0, plan.adapters[0])
    return trainer


def in_slot(samples: list[Sample], slot: int, n: int) -> list[Sample]:
    """`samples` repeated into whole groups of `n` (the adapter's group size), tagged with their slot."""
    repeated = [samples[i % len(samples)] for i in range(n)]
    return [
        Sample(s.tokens, s.response_length, s.loss_mask, [], None, s.status, reward=s.reward, metadata={"slot": slot})
        for s in repeated
    ]


def lora_a(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: t for name, t in trainer.adapter_state().items() if ".lora_A." in name}


def step_norms(optimizer: torch.optim.Optimizer) -> list[float]:
    """The norm of the gradients each optimizer step applies, seen right before it steps (after clipping)."""
    norms: list[float] = []

    def record(opt: torch.optim.Optimizer, *_: object) -> None:
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    optimizer.register_step_pre_hook(record)
    return norms


# ---- run.seed ----


def test_run_seed_sets_the_adapters_initialisation(tiny_model_path):
    first, again, other = (lora_a(fsdp_trainer(tiny_model_path, f"run.seed={seed}")) for seed in (1, 1, 2))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not any(torch.equal(first[name], other[name]) for name in first)


# ---- adapters.dropout ----


def test_adapters_dropout_is_the_lora_dropout_of_the_trained_and_exported_adapter(tiny_model_path, tmp_path):
    trainer = fsdp_trainer(tiny_model_path, "adapters.dropout=0.25")
    dropouts = [m.lora_dropout["default"] for m in trainer.model.modules() if hasattr(m, "lora_dropout")]
    assert dropouts and all(isinstance(d, torch.nn.Dropout) and d.p == 0.25 for d in dropouts)
    assert trainer.adapter_config()["lora_dropout"] == 0.25  # what the engines receive with the tensors
    import json

    saved = json.loads((trainer.save_adapter(tmp_path / "adapter") / "adapter_config.json").read_text())
    assert saved["lora_dropout"] == 0.25


def test_no_dropout_leaves_the_lora_path_deterministic(tiny_model_path):
    trainer = fsdp_trainer(tiny_model_path, "adapters.dropout=0.0")
    assert all(
        isinstance(m.lora_dropout["default"], torch.nn.Identity)
        for m in trainer.model.modules()
        if hasattr(m, "lora_dropout")
    )


# ---- optimizer.* ----

OPTIMIZER = ("optimizer.weight_decay=0.05", "optimizer.adam_beta1=0.8", "optimizer.adam_beta2=0.95")


def test_the_fsdp_optimizer_takes_the_plans_hyperparameters(tiny_model_path):
    [group_] = fsdp_trainer(tiny_model_path, *OPTIMIZER).optimizer.param_groups
    assert (group_["weight_decay"], group_["betas"]) == (0.05, (0.8, 0.95))


def test_each_adapter_slots_optimizer_takes_the_plans_hyperparameters(tiny_model_path):
    [group_] = multi_trainer(tiny_model_path, *OPTIMIZER).slots[0].optimizer.param_groups
    assert (group_["weight_decay"], group_["betas"]) == (0.05, (0.8, 0.95))


@pytest.mark.parametrize("weight_decay", [0.0, 0.5])
def test_weight_decay_shrinks_the_adapter_by_lr_times_decay_each_step(tiny_model_path, weight_decay):
    trainer = fsdp_trainer(tiny_model_path, f"optimizer.weight_decay={weight_decay}")
    before = lora_a(trainer)
    metrics = trainer.train(group([GOOD, BAD], [1.0, 1.0]))  # equal rewards: a zero gradient
    assert metrics["grad_norm"] == 0.0
    shrink = 1 - trainer.settings.adapter.lr * weight_decay
    for name, tensor in lora_a(trainer).items():
        torch.testing.assert_close(tensor, before[name] * shrink)


@pytest.mark.parametrize("clip_grad", [1e-4, 1e4])
def test_the_fsdp_step_is_clipped_at_optimizer_clip_grad(tiny_model_path, clip_grad):
    trainer = fsdp_trainer(tiny_model_path, f"optimizer.clip_grad={clip_grad}")
    applied = step_norms(trainer.optimizer)
    unclipped = trainer.train(group([GOOD, BAD], [1.0, 0.0]))["grad_norm"]
    assert 1e-4 < unclipped < 1e4  # the batch's gradient lies between the two clips
    assert applied == [pytest.approx(min(unclipped, clip_grad), rel=1e-2)]  # torch adds 1e-6 to the norm


@pytest.mark.parametrize("clip_grad", [1e-4, 1e4])
def test_an_adapter_slots_step_is_clipped_at_optimizer_clip_grad(tiny_model_path, clip_grad):
    trainer = multi_trainer(tiny_model_path, f"optimizer.clip_grad={clip_grad}")
    applied = step_norms(trainer.slots[0].optimizer)
    n = trainer.slots[0].adapter.n_samples_per_prompt
    unclipped = trainer.train(in_slot(group([GOOD, BAD], [1.0, 0.0]), 0, n), step_slots=[0])[0]["grad_norm"]
    assert 1e-4 < unclipped < 1e4
    assert applied == [pytest.approx(min(unclipped, clip_grad), rel=1e-2)]  # torch adds 1e-6 to the norm


# ---- algorithm.normalize_advantages_by_std ----


@pytest.mark.parametrize("normalize", [True, False])
def test_normalize_advantages_by_std_makes_the_step_blind_to_the_reward_scale(tiny_model_path, normalize):
    """Std-normalised GRPO advantages of rewards (s, 0) are +-1/sqrt(2) whatever s is; without it they are +-s/2,
    and so is the gradient."""
    norms = []
    for scale in (1.0, 4.0):
        trainer = fsdp_trainer(
            tiny_model_path, f"algorithm.normalize_advantages_by_std={normalize}", "optimizer.clip_grad=1e6"
        )
        norms.append(trainer.train(group([GOOD, BAD], [scale, 0.0]))["grad_norm"])
    assert norms[1] == pytest.approx(norms[0] * (1.0 if normalize else 4.0), rel=1e-3)
