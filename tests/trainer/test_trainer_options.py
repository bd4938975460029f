"""The trainers act on the plan's trainer and algorithm switches: the advantage estimator, per-token loss,
activation recomputation, token-budget micro-batches and the optimizer."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from miles_runner.config.compose import compose
from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.plan.compile import compile_plan
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.advantages import Estimator
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.lora_model import decoder_layers
from miles_runner.trainer.micro_batches import first_fit, plan_micro_batches
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer
from miles_runner.trainer.policy_trainer import TrainerSettings

from .settings import make_settings

PROMPT = [1, 60, 61, 62, 63, 4]
GOOD, BAD = [70, 71, 2], [90, 91, 2]
SGD = OptimizerConfig(name="sgd")  # the update is proportional to the gradient: a different gradient shows


def group(responses: list[list[int]], rewards: list[float], **metadata) -> list[Sample]:
    return [
        Sample(PROMPT + r, len(r), [1] * len(r), [], None, SampleStatus.COMPLETED, reward=w, metadata=metadata)
        for r, w in zip(responses, rewards, strict=True)
    ]


def attention_inputs(trainer) -> list[tuple[int, ...]]:
    """Shapes of the first layer's attention inputs, one per forward (a recompute in backward counts too)."""
    shapes: list[tuple[int, ...]] = []
    layer = decoder_layers(trainer.model)[0].self_attn
    layer.register_forward_hook(
        lambda module, args, kwargs, out: shapes.append(tuple(kwargs["hidden_states"].shape)), with_kwargs=True
    )
    return shapes


def same_adapters(a: FSDPTrainer, b: FSDPTrainer) -> bool:
    return all(
        torch.allclose(x, y, atol=1e-6)
        for x, y in zip(a.adapter_state().values(), b.adapter_state().values(), strict=True)
    )


def test_the_plan_sets_the_trainer_switches():
    plan = compile_plan(
        compose(
            [
                "trainer.calculate_per_token_loss=true",
                "trainer.parallel.recompute=true",
                "trainer.use_dynamic_batch_size=true",
                "trainer.max_tokens_per_gpu=64",
                "algorithm.advantage_estimator=reinforce_plus_plus",
                "algorithm.gamma=0.9",
                "algorithm.kl_coef=0.01",
            ]
        )
    )
    settings = TrainerSettings.from_plan(plan)
    assert (settings.per_token_loss, settings.recompute, settings.max_tokens_per_micro_batch) == (True, True, 64)
    assert settings.estimator() == Estimator("reinforce_plus_plus", plan.batch.n_samples_per_prompt, True, 0.01, 0.9)
    assert settings.loss_config().kl_coef == 0.0  # REINFORCE++ puts the KL into the reward
    multi = MultiLoRASettings.from_plan(plan)
    assert (multi.recompute, multi.max_tokens_per_micro_batch) == (True, 64)


@pytest.mark.parametrize(("per_token", "expected"), [(False, 0.0), (True, -(3 - 2) / math.sqrt(2) / 5)])
def test_per_token_loss_weighs_each_sample_by_its_trained_tokens(tiny_model_path, per_token, expected):
    # Advantages +-1/sqrt(2) (rewards 1 and 0, std-normalised); on-policy the ratio is 1, so the loss is
    # -sum(A_i * n_i) / 5 tokens per token, and -sum(A_i) / 2 samples per sample.
    trainer = FSDPTrainer(tiny_model_path, make_settings(per_token_loss=per_token))
    metrics = trainer.train(group([GOOD, [90, 2]], [1.0, 0.0]))  # 3 and 2 trained tokens
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)


def test_recompute_replays_each_layer_in_backward_and_leaves_the_update_unchanged(tiny_model_path):
    plain = FSDPTrainer(tiny_model_path, make_settings(optimizer=SGD))
    recomputed = FSDPTrainer(tiny_model_path, make_settings(optimizer=SGD, recompute=True))
    plain_calls, recomputed_calls = attention_inputs(plain), attention_inputs(recomputed)
    samples = group([GOOD, BAD], [1.0, 0.0])
    plain.train(samples)
    recomputed.train(samples)
    assert (len(plain_calls), len(recomputed_calls)) == (1, 2)  # one micro-batch: its forward, then the replay
    assert same_adapters(plain, recomputed)


def test_first_fit_fills_the_first_bin_with_room():
    assert first_fit([9, 8, 8, 7], 16) == [[0, 3], [1, 2]]
    assert first_fit([20, 3], 16) == [[0], [1]]  # a sample over the budget sits alone


def test_micro_batches_split_further_to_the_count_every_rank_runs():
    # bins [0, 3] and [1, 2]; the first fullest is halved
    assert plan_micro_batches([9, 8, 8, 7], size=1, max_tokens=16, count=3) == [[0], [3], [1, 2]]
    assert plan_micro_batches([9, 8, 8, 7], size=3, max_tokens=0) == [[0, 1, 2], [3]]


def test_a_token_budget_packs_micro_batches_and_leaves_the_update_unchanged(tiny_model_path):
    samples = group([GOOD, [90, 2], [70, 2], [2]], [1.0, 0.0, 0.5, 0.0])  # 9, 8, 8 and 7 tokens
    fixed = FSDPTrainer(tiny_model_path, make_settings(optimizer=SGD, micro_batch_size=1))
    packed = FSDPTrainer(
        tiny_model_path, make_settings(optimizer=SGD, micro_batch_size=1, max_tokens_per_micro_batch=16)
    )
    fixed_calls, packed_calls = attention_inputs(fixed), attention_inputs(packed)
    fixed.train(samples)
    packed.train(samples)
    assert len(fixed_calls) == 4
    # first fit into 16 tokens: [9 + 7], [8 + 8]; each micro-batch cut to its longest sample
    assert [shape[:2] for shape in packed_calls] == [(2, 9), (2, 8)]
    assert same_adapters(fixed, packed)


def test_muon_steps_each_lora_matrix_by_an_orthogonalised_update(tiny_model_path):
    muon = OptimizerConfig(name="muon", weight_decay=0.0)
    trainer = FSDPTrainer(tiny_model_path, make_settings(optimizer=muon))
    assert isinstance(trainer.optimizer, torch.optim.Muon)
    b_matrices = {n: p for n, p in trainer.model.named_parameters() if ".lora_B." in n}
    before = {n: p.detach().clone() for n, p in b_matrices.items()}
    trainer.train(group([GOOD, BAD], [1.0, 0.0]))
    for name, param in b_matrices.items():
        singular = torch.linalg.svdvals(param.detach() - before[name])
        # Newton-Schulz flattens the spectrum: every direction of the update moves by about the same amount
        assert singular.min() > 0.5 * singular.max(), name


@pytest.mark.parametrize("estimator", ["gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_each_estimator_raises_the_rewarded_response_and_lowers_the_other(tiny_model_path, estimator):
    algorithm = replace(AlgorithmConfig(), advantage_estimator=estimator, kl_coef=0.01)
    trainer = FSDPTrainer(tiny_model_path, make_settings(algorithm=algorithm))
    samples = group([GOOD, BAD], [1.0, 0.0])
    before = [sum(lp) for lp in trainer.compute_log_probs(samples)]
    for _ in range(3):
        metrics = trainer.train(samples)
    after = [sum(lp) for lp in trainer.compute_log_probs(samples)]
    assert after[0] > before[0] and after[1] < before[1]
    assert metrics["kl"] > 0.0


@pytest.mark.parametrize(("estimator", "kl_in_loss"), [("grpo", True), ("reinforce_plus_plus", False)])
def test_the_kl_is_a_loss_term_for_grpo_and_a_reward_penalty_for_reinforce(tiny_model_path, estimator, kl_in_loss):
    algorithm = replace(AlgorithmConfig(), advantage_estimator=estimator, kl_coef=0.5)
    trainer = FSDPTrainer(tiny_model_path, make_settings(algorithm=algorithm))
    samples = group([GOOD, BAD], [1.0, 0.0])
    trainer.train(samples)  # moves the adapter off the reference
    metrics = trainer.train(samples)
    assert metrics["kl"] > 0.0
    assert (metrics["loss"] - metrics["pg_loss"]) == pytest.approx(0.5 * metrics["kl"] if kl_in_loss else 0.0, abs=1e-6)


def test_the_multi_lora_trainer_uses_the_estimator_and_the_token_budget(tiny_model_path):
    algorithm = replace(AlgorithmConfig(), advantage_estimator="reinforce_plus_plus_baseline")
    settings = MultiLoRASettings(
        algorithm, OptimizerConfig(lr=0.05), micro_batch_size=4, max_tokens_per_micro_batch=9, recompute=True
    )
    trainer = PeftMultiLoRATrainer(tiny_model_path, settings)
    adapter = AdapterSpec("a", "__miles_slot_0", 4, 8.0, 0.0, ["q_proj", "v_proj"], "count", "exact_match", 0.05, 1, 2)
    trainer.load_adapter(0, adapter)
    calls = attention_inputs(trainer)
    metrics = trainer.train(group([GOOD, [90, 2]], [1.0, 0.0], slot=0), step_slots=[0])
    # 9 and 8 tokens do not fit one budget of 9: two micro-batches, each replayed in backward
    assert [shape[:2] for shape in calls] == [(1, 9), (1, 9), (1, 8), (1, 8)]
    assert metrics[0]["step"] == 1 and metrics[0]["grad_norm"] > 0.0
