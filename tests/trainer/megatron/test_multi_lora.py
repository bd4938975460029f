"""Megatron multi-LoRA (raw LoRA slots): each slot trains exactly as the one-adapter Megatron trainer trains the
same adapter alone, with R3 replayed; gradients kept across train calls; a slot that does not step does not move;
two ranks (data parallel; TP=2 + EP=2 with sequence parallelism) take the one-process steps; a checkpoint resumes."""

from __future__ import annotations

import json

import pytest
import torch

from miles_runner.config.schema import AlgorithmConfig
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.multi_lora import MegatronMultiLoRATrainer
from miles_runner.trainer.multi_lora import MultiLoRASettings
from tests.trainer.ranks_helper import run_ranks

from .multi_lora_case import ADAPTERS, SGD, multi_case, samples, single_reference, start_state

pytestmark = pytest.mark.integration

WORKER = "tests.trainer.megatron.multi_lora_worker"


@pytest.fixture(scope="module")
def starts(tiny_model_path):
    return {slot: start_state(tiny_model_path, slot) for slot in ADAPTERS}


@pytest.fixture(scope="module")
def one_process(tiny_model_path, starts):
    return multi_case(tiny_model_path, parallel.Layout(), starts)


@pytest.mark.parametrize("slot", sorted(ADAPTERS))
def test_each_slot_takes_the_step_of_its_adapter_trained_alone(tiny_model_path, starts, one_process, slot):
    alone = single_reference(tiny_model_path, slot, starts[slot])
    together = one_process["after"][slot]
    assert set(together) == set(alone)
    moved = max(float((together[k] - starts[slot][k]).abs().max()) for k in together)
    assert moved > 1e-3  # the step did something
    for name, tensor in alone.items():
        assert torch.allclose(together[name], tensor, atol=1e-6), name


def test_each_slot_keeps_its_own_rank_alpha_and_targets(one_process):
    attn, mlp = one_process["configs"][0], one_process["configs"][1]
    assert (attn["r"], attn["lora_alpha"]) == (4, 8.0) and (mlp["r"], mlp["lora_alpha"]) == (8, 8.0)
    assert not any(".mlp." in name for name in one_process["after"][0])
    assert not any(".q_proj." in name for name in one_process["after"][1])
    assert "target_parameters" in mlp  # its expert LoRA, as peft names it


def test_gradients_are_kept_until_the_slot_steps_and_replay_routes(one_process):
    first, second = one_process["metrics"]
    assert "grad_norm" not in first[0] and "grad_norm" in second[0]
    assert second[0]["step_samples"] == 4  # both calls' samples in one step
    assert 0 < first[0]["routing_replay_diff_frac"] <= 1  # the rollout's routes, not the trainer's own


def test_a_slot_that_does_not_step_does_not_move(one_process):
    for name, tensor in one_process["after"][1].items():
        assert torch.equal(one_process["slot1_untouched"][name], tensor), name


@pytest.mark.parametrize("layout", [{}, {"tp": 2, "ep": 2, "sp": True}], ids=["dp2", "tp2-ep2-sp"])
def test_two_ranks_take_the_one_process_steps(tiny_model_path, starts, one_process, layout, tmp_path):
    torch.save(starts, tmp_path / "starts.pt")
    run_ranks(WORKER, 2, [tiny_model_path, tmp_path / "starts.pt", json.dumps(layout), tmp_path / "out.pt"], 300)
    two = torch.load(tmp_path / "out.pt")
    for slot in ADAPTERS:
        for name, tensor in one_process["after"][slot].items():
            assert torch.allclose(two["after"][slot][name], tensor, atol=1e-5), (slot, name)
        assert two["metrics"][1][slot]["grad_norm"] == pytest.approx(
            one_process["metrics"][1][slot]["grad_norm"], rel=1e-4
        )
    if not layout:  # two data-parallel ranks: a slot's odd sample count is refused on both, before any forward
        assert "do not split over 2 data-parallel ranks" in two["odd_batch_error"]


def test_a_slot_checkpoint_resumes_and_a_cleared_slot_starts_fresh(tiny_model_path, one_process):
    settings = MultiLoRASettings(AlgorithmConfig(), SGD, 4, routing_replay=True)
    trainer = MegatronMultiLoRATrainer(tiny_model_path, settings, parallel.Layout())
    trainer.load_adapter(0, ADAPTERS[0], one_process["state"])
    assert trainer.adapter_step(0) == 1
    for name, tensor in one_process["after"][0].items():
        assert torch.equal(trainer.adapter_state(0)[name], tensor), name
    trainer.train(samples(0, trainer.model.hf_config)[:2], step_slots=[0])
    assert trainer.adapter_step(0) == 2
    trainer.clear_adapter(0)
    trainer.load_adapter(0, ADAPTERS[0])
    assert trainer.adapter_step(0) == 0
    assert all(float(t.abs().max()) == 0 for k, t in trainer.adapter_state(0).items() if ".lora_B." in k)
