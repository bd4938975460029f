"""The multi-LoRA trainer on the tiny model: per-slot optimizers and step scale, gradients kept across train
calls until a slot steps, fresh state for a reused slot, and per-slot checkpoints."""

from __future__ import annotations

import pytest
import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer

pytestmark = pytest.mark.integration

GROUP = 2  # samples per prompt


def adapter(name: str, slot: int, *, rank: int = 4) -> AdapterSpec:
    return AdapterSpec(
        name=name,
        lora_name=f"__miles_slot_{slot}",
        rank=rank,
        alpha=8.0,
        dropout=0.0,
        target_modules=["q_proj", "v_proj"],
        task="count",
        reward="exact_match",
        lr=0.05,
        rollout_batch_size=2,
        n_samples_per_prompt=GROUP,
    )


def group(slot: int, seed: int) -> list[Sample]:
    """One prompt's samples for `slot`: the same prompt, different answers, one rewarded."""
    return [
        Sample(
            tokens=[3, 4, 5, 6, 10 + seed + k],
            response_length=1,
            loss_mask=[1],
            rollout_log_probs=[-1.0],
            rollout_routed_experts=None,
            status=SampleStatus.COMPLETED,
            reward=float(k == 0),
            metadata={"slot": slot},
        )
        for k in range(GROUP)
    ]


@pytest.fixture()
def trainer() -> PeftMultiLoRATrainer:
    settings = MultiLoRASettings(AlgorithmConfig(), OptimizerConfig(lr=0.05), micro_batch_size=4)
    trained = PeftMultiLoRATrainer(ensure_tiny_model("tiny-moe"), settings)
    trained.load_adapter(0, adapter("a", 0))
    trained.load_adapter(1, adapter("b", 1))
    return trained


def tensors(trainer: PeftMultiLoRATrainer, slot: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.adapter_state(slot).items()}


def same(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def test_only_step_slots_change_and_the_others_keep_their_gradients(trainer):
    a_before, b_before = tensors(trainer, 0), tensors(trainer, 1)
    metrics = trainer.train([*group(0, 0), *group(1, 0)], step_slots=[0])
    assert not same(tensors(trainer, 0), a_before)
    assert same(tensors(trainer, 1), b_before)
    assert all(p.grad is not None for p in trainer.slots[1].params)  # kept for b's step
    assert all(p.grad is None for p in trainer.slots[0].params)
    assert metrics[0]["step"] == 1 and "step" not in metrics[1]


def test_a_step_averages_over_every_train_call_since_the_last_one(trainer):
    """Two calls of one group each, then the step: the same update as one call with both groups."""
    settings = trainer.settings
    twin = PeftMultiLoRATrainer(ensure_tiny_model("tiny-moe"), settings)
    twin.load_adapter(0, adapter("a", 0))
    assert same(tensors(twin, 0), tensors(trainer, 0))
    trainer.train(group(0, 0), step_slots=[])
    metrics = trainer.train(group(0, 1), step_slots=[0])
    twin.train([*group(0, 0), *group(0, 1)], step_slots=[0])
    assert metrics[0]["step_samples"] == 2 * GROUP
    for key, value in tensors(twin, 0).items():
        torch.testing.assert_close(tensors(trainer, 0)[key], value)


def test_adapters_export_in_peft_naming_under_their_slot_config(trainer):
    state = trainer.adapter_state(1)
    assert state and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert trainer.adapter_config(1)["r"] == 4


def test_a_reused_slot_starts_with_a_fresh_adapter_and_optimizer(trainer):
    trainer.train(group(0, 0), step_slots=[0])
    trainer.clear_adapter(0)
    trainer.load_adapter(0, adapter("c", 0, rank=2))
    assert trainer.slots[0].step == 0 and trainer.slots[0].optimizer.state_dict()["state"] == {}
    assert all(torch.count_nonzero(t) == 0 for k, t in trainer.adapter_state(0).items() if "lora_B" in k)
    assert trainer.adapter_config(0)["r"] == 2


def test_slot_state_round_trips_adapter_optimizer_and_step(trainer):
    trainer.train(group(0, 0), step_slots=[0])
    saved, exported = trainer.state_dict(0), tensors(trainer, 0)
    trainer.clear_adapter(0)
    trainer.load_adapter(0, adapter("a", 0), saved)
    assert same(tensors(trainer, 0), exported) and trainer.slots[0].step == 1
    assert trainer.slots[0].optimizer.state_dict()["state"]  # Adam moments restored


def test_samples_for_an_empty_slot_are_refused(trainer):
    with pytest.raises(ValueError, match="hold no adapter"):
        trainer.train(group(3, 0), step_slots=[])
