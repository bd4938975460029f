"""Routing replay (R3) on the Megatron-Bridge model (one process, tiny-moe): the same RouteReplay hooks as
lora_mode=raw route Bridge's GPTModel, so replaying the same routes gives the raw model's logits and counts, and
not the model's own routing; its routing layout is the HF model's; a recomputed layer routes in the backward as
its forward did."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..parity_case import batch, random_routes
from .bridge_case import adapter

TOLERANCE = 1e-5  # the same megatron-core model on both sides: measured 0.0


def logits_of(model, routes: torch.Tensor | None):
    from miles_runner.trainer.megatron.model import replay_routing
    from miles_runner.trainer.routing_replay import ReplayStats

    ids, mask = batch(model.vocab_size)
    stats = ReplayStats()
    with torch.no_grad(), replay_routing(model, routes, stats):
        return model(input_ids=ids, attention_mask=mask).logits, stats


@pytest.fixture(scope="module")
def models(tiny_moe_path):
    """The raw megatron model and the Bridge model of tiny-moe, both built for replay (Bridge's LoRA B is zero:
    its logits are the base model's)."""
    from miles_runner.trainer.megatron import convert, parallel
    from miles_runner.trainer.megatron.bridge import build_bridge_lora_model
    from miles_runner.trainer.megatron.model import build_model

    parallel.initialize(parallel.Layout())
    hf_config = json.loads((Path(tiny_moe_path) / "config.json").read_text())
    raw = build_model(hf_config, parallel.Layout(), routing_replay=True)
    convert.load_hf_checkpoint(raw, tiny_moe_path)
    bridge = build_bridge_lora_model(tiny_moe_path, adapter(), parallel.Layout(), routing_replay=True)
    yield raw, bridge
    parallel.destroy()


@pytest.fixture(scope="module")
def routes(models) -> torch.Tensor:
    from miles_runner.trainer.megatron.model import routing_layout

    layout = routing_layout(models[1])
    return random_routes(batch(models[1].vocab_size)[0], layout.num_layers, layout.top_k, layout.num_experts)


def test_the_bridge_models_routing_layout_is_the_hf_models(models, tiny_moe_path):
    from transformers import AutoModelForCausalLM

    from miles_runner.models.moe_routing import routing_layout as hf_routing_layout
    from miles_runner.trainer.megatron.model import routing_layout

    raw, bridge = models
    hf = AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    assert routing_layout(bridge) == routing_layout(raw) == hf_routing_layout(hf)
    assert bridge.routing_replay


def test_replayed_routes_give_the_raw_models_logits_and_counts(models, routes):
    raw, bridge = models
    real = batch(bridge.vocab_size)[1].bool()
    expected, raw_stats = logits_of(raw, routes)
    replayed, stats = logits_of(bridge, routes)
    own, _ = logits_of(bridge, None)
    assert float((replayed - expected)[real].abs().max()) < TOLERANCE
    assert (stats.tokens, stats.differing) == (raw_stats.tokens, raw_stats.differing)
    assert stats.differing > 0
    assert float((replayed - own)[real].abs().max()) > 1e-2  # the replay decided the routing


def grads_after_two_micro_batches(model, routes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Both micro-batches' forwards (other routes each) before either backward, so each replay is over by then."""
    from miles_runner.trainer.megatron.model import replay_routing

    ids, mask = batch(model.vocab_size)
    model.zero_grad(set_to_none=True)
    losses = []
    for rows in (routes, routes.roll(1, dims=-1)):
        with replay_routing(model, rows):
            logits = model(input_ids=ids, attention_mask=mask).logits
        losses.append(logits.log_softmax(-1)[..., 5].sum())
    for loss in losses:
        loss.backward()
    return {name: p.grad.clone() for name, p in model.gpt.named_parameters() if p.grad is not None}


def test_recomputed_layers_route_in_the_backward_as_their_forward_did(models, routes, tiny_moe_path):
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.megatron.bridge import build_bridge_lora_model

    plain, recomputing = (
        build_bridge_lora_model(tiny_moe_path, adapter(), parallel.Layout(), routing_replay=True, recompute=recompute)
        for recompute in (False, True)
    )
    with torch.no_grad():  # B starts at zero: the same nonzero adapter on both, so every LoRA tensor gets a gradient
        for ours, theirs in zip(plain.lora_parameters(), recomputing.lora_parameters(), strict=True):
            ours.copy_(torch.randn_like(ours) * 0.1)
            theirs.copy_(ours)
    expected = grads_after_two_micro_batches(plain, routes)
    recomputed = grads_after_two_micro_batches(recomputing, routes)
    assert expected.keys() == recomputed.keys() and len(expected) > 10
    for name, grad in expected.items():
        assert torch.allclose(recomputed[name], grad, atol=1e-5), name


def test_replay_changes_what_the_adapter_learns(one_rank):
    # bridge_case under replay (the reference of the two-process replay case) trains on other routes than its own
    replayed, own = one_rank["tiny-moe-replay"], one_rank["tiny-moe"]
    assert max(float((replayed["after"][k] - own["after"][k]).abs().max()) for k in own["after"]) > 1e-3
    assert replayed["losses"] != pytest.approx(own["losses"], rel=1e-3)
