"""Routing replay (R3) in the trainers: every MoE layer routes each token to the experts the rollout recorded, even
after the routers moved; the gate weights are the trainer's own softmax at those experts; the replayed share that
differs from the trainer's own choice is reported; a sample whose rows are missing or misaligned is an error
naming it, never a fall back to the trainer's own routing.

Rollouts here are in-process (HF generate recording its routers, rollout/inprocess.py); the engine's rows are
checked the same way in test_routing_replay_engine.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.models.moe_routing import moe_routers, recording, routing_layout
from miles_runner.plugins.lookup import get_reward, make_task
from miles_runner.rollout.inprocess import SamplingSettings, generate_samples
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.logprobs import pack_samples, token_log_probs
from miles_runner.trainer.multi_lora import MultiLoRASettings, PeftMultiLoRATrainer
from miles_runner.trainer.routing_replay import NO_ROW, ReplayStats, differs, replaying
from miles_testkit.routing_gap import move_routers

from .settings import ATTENTION, make_settings

pytestmark = pytest.mark.integration

PROMPTS, PER_PROMPT = 3, 2


@pytest.fixture(scope="module")
def rollout(tiny_model_path) -> list[Sample]:
    """Rewarded samples with the routing their generation recorded, from the base model (a fresh adapter is the
    identity, so every trainer below starts from the same routing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
    task = make_task("count", 0)
    prompts = [task.prompt(i) for i in range(PROMPTS)]
    torch.manual_seed(0)
    settings = SamplingSettings(max_new_tokens=6, return_routed_experts=True)
    samples = generate_samples(model, tokenizer, task, prompts, PER_PROMPT, get_reward("exact_match"), settings)
    for k, sample in enumerate(samples):
        sample.reward = float(k % 2)  # a signal to train on whatever the tiny model answered
    return samples


def copies(samples: list[Sample]) -> list[Sample]:
    return [dataclasses.replace(s, metadata=dict(s.metadata)) for s in samples]


def fsdp_trainer(path: str, replay: bool) -> FSDPTrainer:
    return FSDPTrainer(path, make_settings(routing_replay=replay, micro_batch_size=PROMPTS * PER_PROMPT))


def multi_lora_trainer(path: str, replay: bool) -> PeftMultiLoRATrainer:
    settings = MultiLoRASettings(
        AlgorithmConfig(), OptimizerConfig(), micro_batch_size=PROMPTS * PER_PROMPT, routing_replay=replay
    )
    trainer = PeftMultiLoRATrainer(path, settings)
    spec = AdapterSpec("a", "__miles_slot_0", 4, 8.0, 0.0, ATTENTION, "count", "exact_match", 0.01, PROMPTS, PER_PROMPT)
    trainer.load_adapter(0, spec)
    return trainer


def train(trainer, samples: list[Sample]) -> dict[str, float]:
    if isinstance(trainer, PeftMultiLoRATrainer):
        for sample in samples:
            sample.metadata["slot"] = 0
        return trainer.train(samples, step_slots=[0])[0]
    return trainer.train(samples)


def routed_in_training(trainer, samples: list[Sample]) -> tuple[dict[int, torch.Tensor], dict[str, float]]:
    """The experts every router sent each position to in the training forward ``[B, L, top_k]`` per layer."""
    with recording(trainer.model) as chosen:
        metrics = train(trainer, samples)
    [forward] = {len(c) for c in chosen.values()}  # one micro-batch, no other forward (on-policy, no KL)
    assert forward == 1
    width = max(len(s.tokens) for s in samples)
    return {layer: c[0].reshape(len(samples), width, -1) for layer, c in chosen.items()}, metrics


def rollout_rows(samples: list[Sample], layer: int, width: int) -> torch.Tensor:
    rows = torch.full((len(samples), width, samples[0].rollout_routed_experts.shape[2]), NO_ROW)
    for i, s in enumerate(samples):
        rows[i, : len(s.tokens) - 1] = torch.from_numpy(s.rollout_routed_experts[:, layer, :]).long()
    return rows


# ---- from the plan ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["tiny_lora_agentic", "tiny_multi_lora"])
def test_rollout_routing_replay_in_the_plan_turns_replay_on_in_its_trainer(recipe):
    from miles_runner.config.compose import compose
    from miles_runner.plan.compile import compile_plan
    from miles_runner.trainer.policy_trainer import TrainerSettings

    for replay in (True, False):
        plan = compile_plan(compose([f"+recipe={recipe}", f"rollout.routing_replay={str(replay).lower()}"]))
        settings = MultiLoRASettings if plan.capabilities.multi_lora else TrainerSettings
        assert settings.from_plan(plan).routing_replay is replay


def test_the_inprocess_loop_replays_what_its_rollouts_recorded(tiny_model_path):
    from miles_runner.loops.inprocess import LocalRunConfig, run_local_grpo

    adapter = AdapterSpec("miles_lora", "miles_lora", 4, 8.0, 0.0, ATTENTION, "count", "exact_match", 0.01, 2, 2)
    sampling = SamplingSettings(max_new_tokens=4, return_routed_experts=True)
    result = run_local_grpo(LocalRunConfig(tiny_model_path, adapter, sampling, steps=2, micro_batch_size=4))
    assert [m["routing_replay_diff_frac"] for m in result.metrics] == [0.0, 0.0]  # it generated with these routers


# ---- the rollout's rows -------------------------------------------------------------------------------------


def test_an_inprocess_rollout_carries_one_row_per_token_but_the_last(rollout, tiny_model_path):
    layout = routing_layout(FSDPTrainer(tiny_model_path, make_settings()).model)
    for sample in rollout:
        assert sample.rollout_routed_experts.shape == (len(sample.tokens) - 1, layout.num_layers, layout.top_k)
        assert sample.rollout_routed_experts.dtype == np.int32


def test_unmoved_routers_choose_exactly_the_rollout_rows(rollout, tiny_model_path):
    """Row i is token i's routing: the trainer, routing on its own with the rollout's weights, agrees everywhere
    (an off-by-one would route most tokens elsewhere)."""
    trainer = fsdp_trainer(tiny_model_path, replay=True)
    stats = ReplayStats()
    token_log_probs(trainer.model, pack_samples(rollout, trainer.pad_id, trainer.routing), replay_stats=stats)
    assert stats.tokens == sum(len(s.tokens) - 1 for s in rollout)
    assert stats.differing == 0


# ---- replay ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make_trainer", [fsdp_trainer, multi_lora_trainer], ids=["fsdp", "multi_lora"])
def test_training_routes_every_token_as_the_rollout_did_after_the_routers_moved(rollout, tiny_model_path, make_trainer):
    replayed, own = make_trainer(tiny_model_path, replay=True), make_trainer(tiny_model_path, replay=False)
    move_routers(replayed.model, 0.1)
    move_routers(own.model, 0.1)
    chosen, metrics = routed_in_training(replayed, copies(rollout))
    chosen_own, _ = routed_in_training(own, copies(rollout))
    width = max(len(s.tokens) for s in rollout)
    for layer in routing_layout(replayed.model).moe_layers:
        rows = rollout_rows(rollout, layer, width)
        has_row = rows[..., 0] != NO_ROW
        assert torch.equal(chosen[layer][has_row], rows[has_row])
        assert not torch.equal(chosen_own[layer][has_row], rows[has_row])  # the routers did move
    assert 0.0 < metrics["routing_replay_diff_frac"] <= 1.0


def test_layers_recomputed_in_the_backward_route_as_the_rollout_did(rollout, tiny_model_path):
    """Activation checkpointing runs every layer's forward again in the backward: that pass replays too."""
    trainer = FSDPTrainer(tiny_model_path, make_settings(routing_replay=True, recompute=True, micro_batch_size=6))
    move_routers(trainer.model, 0.1)
    samples = copies(rollout)
    with recording(trainer.model) as chosen:
        trainer.train(samples)
    width = max(len(s.tokens) for s in samples)
    for layer, calls in chosen.items():
        rows = rollout_rows(rollout, layer, width)
        has_row = rows[..., 0] != NO_ROW
        assert len(calls) == 2  # the forward, and its recompute in the backward
        for call in calls:
            assert torch.equal(call.reshape(len(samples), width, -1)[has_row], rows[has_row])
    assert all("forward" not in router.__dict__ for _, router in moe_routers(trainer.model))  # restored after


def test_without_replay_no_routing_metric_is_reported(rollout, tiny_model_path):
    assert "routing_replay_diff_frac" not in fsdp_trainer(tiny_model_path, replay=False).train(copies(rollout))


def test_gate_weights_are_the_trainers_softmax_over_all_experts_at_the_replayed_ones(tiny_model_path):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = AutoConfig.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    for normalise in (True, False):
        config.norm_topk_prob = normalise
        router = Qwen3MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight, std=0.5)
        layer = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([torch.nn.ModuleDict({"gate": router})])})
        hidden = torch.randn(1, 5, config.hidden_size)
        target = torch.tensor([[[[0, 1]], [[7, 2]], [[3, 4]], [[5, 6]], [[6, 0]]]], dtype=torch.int32)
        with replaying(layer, target):
            logits, weights, experts = router(hidden)
        probs = torch.softmax(hidden.reshape(5, -1) @ router.weight.T, dim=-1)
        expected = probs.gather(1, target[0, :, 0].long())
        if normalise:
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.equal(experts, target[0, :, 0].long())
        assert torch.allclose(weights, expected, atol=1e-6)
        assert torch.allclose(logits, hidden.reshape(5, -1) @ router.weight.T, atol=1e-6)


def test_replay_gives_the_router_gradients_through_the_gate_weights(tiny_model_path):
    trainer = fsdp_trainer(tiny_model_path, replay=True)
    [(_, router)] = moe_routers(trainer.model)[-1:]
    router.weight.requires_grad_(True)
    rows = np.tile(np.array([[[0, 1]]], dtype=np.int32), (6, 2, 1))  # 7 tokens: 6 rows
    sample = Sample([1, 60, 61, 62, 4, 70, 71], 2, [1, 1], [], rows, SampleStatus.COMPLETED)
    log_probs, _ = token_log_probs(trainer.model, pack_samples([sample], trainer.pad_id, trainer.routing))
    log_probs.sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# ---- the diff metric ------------------------------------------------------------------------------------------


def test_differs_compares_expert_sets_not_their_order():
    own = torch.tensor([[1, 2], [1, 2], [1, 2]])
    replayed = torch.tensor([[2, 1], [1, 3], [4, 5]])
    assert differs(own, replayed).tolist() == [False, True, True]


def test_the_diff_fraction_counts_exactly_the_tokens_routed_elsewhere(rollout, tiny_model_path):
    """A constructed case: the rollout rows with the last MoE layer changed on known tokens. Nothing before that
    layer changes, so the trainer's own choice there is the rollout's and exactly those tokens differ."""
    trainer = fsdp_trainer(tiny_model_path, replay=True)
    last = routing_layout(trainer.model).moe_layers[-1]
    samples, changed = copies(rollout), 0
    for i, sample in enumerate(samples):
        rows = sample.rollout_routed_experts.copy()
        for row in range(i % 3, len(rows), 3):  # every third token, from a different start in each sample
            unused = sorted(set(range(8)) - set(rows[row, last].tolist()))
            rows[row, last, 0] = unused[0]
            changed += 1
        sample.rollout_routed_experts = rows
    stats = ReplayStats()
    token_log_probs(trainer.model, pack_samples(samples, trainer.pad_id, trainer.routing), replay_stats=stats)
    assert (stats.differing, stats.tokens) == (changed, sum(len(s.tokens) - 1 for s in samples))
    assert stats.diff_frac == pytest.approx(changed / stats.tokens)


# ---- bad rows: an error naming the sample and the row, never the trainer's own routing ------------------------


def _without_rows(rows: np.ndarray) -> None:
    return None


BAD_ROWS = {
    "missing": (_without_rows, r"sample 1 \(prompt 0\) has no rollout_routed_experts"),
    "one_short": (lambda r: r[:-1], r"sample 1 \(prompt 0\): .*tokens \d+\.\.\d+ have no row"),
    "one_extra": (lambda r: np.concatenate([r, r[-1:]]), r"sample 1 \(prompt 0\): .*rows \d+\.\.\d+ have no token"),
    "no_layer_axis": (lambda r: r[:, 0, :], r"sample 1 \(prompt 0\): rollout_routed_experts has shape"),
    "expert_out_of_range": (lambda r: _set(r, 4, 9), r"sample 1 \(prompt 0\): row 4 layer 1 routes to expert \[9, "),
    "expert_twice": (lambda r: _set(r, 2, int(r[2, 1, 1])), r"sample 1 \(prompt 0\): row 2 layer 1 names an expert"),
}


def _set(rows: np.ndarray, row: int, expert: int) -> np.ndarray:
    rows = rows.copy()
    rows[row, 1, 0] = expert
    return rows


@pytest.mark.parametrize("case", BAD_ROWS, ids=list(BAD_ROWS))
def test_bad_rows_are_an_error_naming_the_sample_and_row(rollout, tiny_model_path, case):
    corrupt, message = BAD_ROWS[case]
    samples = copies(rollout)
    samples[1].rollout_routed_experts = corrupt(samples[1].rollout_routed_experts)
    trainer = fsdp_trainer(tiny_model_path, replay=True)
    before = {k: v.clone() for k, v in trainer.adapter_state().items()}
    with pytest.raises(ValueError, match=message):
        trainer.train(samples)
    with pytest.raises(ValueError, match=message):
        trainer.compute_log_probs(samples)
    assert all(torch.equal(v, before[k]) for k, v in trainer.adapter_state().items())  # nothing trained


def test_the_multi_lora_trainer_refuses_a_sample_without_rows(rollout, tiny_model_path):
    samples = copies(rollout)
    samples[3].rollout_routed_experts = None
    with pytest.raises(ValueError, match=r"sample 3 \(prompt 1\) has no rollout_routed_experts"):
        train(multi_lora_trainer(tiny_model_path, replay=True), samples)


def test_replay_needs_a_moe_model():
    from miles_runner.models.tiny_model import ensure_tiny_model

    with pytest.raises(ValueError, match=r"routing replay needs a MoE model .* model_type 'qwen3' has none"):
        FSDPTrainer(ensure_tiny_model("tiny-dense"), make_settings(routing_replay=True))
