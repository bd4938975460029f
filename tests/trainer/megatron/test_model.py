"""Routing replay on the megatron model routes exactly as the HF replay (trainer/routing_replay.replaying) does:
the same logits and counts for the same routes, the model's own routes change nothing, and the layout matches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles_runner.models.moe_routing import recording
from miles_runner.models.moe_routing import routing_layout as hf_routing_layout
from miles_runner.trainer.megatron import convert, parallel
from miles_runner.trainer.megatron.model import build_model, replay_routing, routing_layout
from miles_runner.trainer.routing_replay import ReplayStats, replaying

from .parity_case import REAL, WIDTH, batch, random_routes

REAL_POSITIONS = torch.tensor([[1] * real + [0] * (WIDTH - real) for real in REAL], dtype=torch.bool)


@pytest.fixture(scope="module")
def models(tiny_moe_path):
    parallel.initialize(parallel.Layout())
    config = json.loads((Path(tiny_moe_path) / "config.json").read_text())
    ours = build_model(config, parallel.Layout(), routing_replay=True)
    convert.load_hf_checkpoint(ours, tiny_moe_path)
    yield ours, AutoModelForCausalLM.from_pretrained(tiny_moe_path, dtype=torch.float32)
    parallel.destroy()


def replayed_logits(model, replay, routes) -> tuple[torch.Tensor, ReplayStats]:
    ids, mask = batch(400)
    stats = ReplayStats()
    with torch.no_grad(), replay(model, routes, stats):
        return model(input_ids=ids, attention_mask=mask).logits, stats


def test_the_routing_layout_is_the_hf_models(models):
    ours, hf = models
    assert routing_layout(ours) == hf_routing_layout(hf)


def test_replayed_routes_give_the_hf_replays_logits_and_counts(models):
    ours, hf = models
    layout = routing_layout(ours)
    routes = random_routes(batch(400)[0], layout.num_layers, layout.top_k, layout.num_experts)
    mine, my_stats = replayed_logits(ours, replay_routing, routes)
    theirs, their_stats = replayed_logits(hf, replaying, routes)
    assert (mine - theirs)[REAL_POSITIONS].abs().max().item() < 1e-5
    assert (my_stats.tokens, my_stats.differing) == (their_stats.tokens, their_stats.differing)
    assert my_stats.differing > 0


def test_replaying_the_models_own_routes_changes_nothing(models):
    ours, hf = models
    ids, mask = batch(400)
    with torch.no_grad(), recording(hf) as captured:
        hf(input_ids=ids, attention_mask=mask)
    own = torch.stack([captured[layer][0] for layer in sorted(captured)], dim=1).reshape(*ids.shape, len(captured), -1)
    with torch.no_grad():
        plain = ours(input_ids=ids, attention_mask=mask).logits
    replayed, stats = replayed_logits(ours, replay_routing, own.to(torch.int32))
    assert (replayed - plain)[REAL_POSITIONS].abs().max().item() < 1e-6
    assert stats.tokens == ids.numel() and stats.differing == 0


def test_replay_needs_a_model_built_for_it(models, tiny_moe_path, tiny_dense_path):
    ours, _ = models
    config = json.loads((Path(tiny_moe_path) / "config.json").read_text())
    plain = build_model(config, parallel.Layout())
    routes = torch.zeros(2, WIDTH, 2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="routing_replay=True"), replay_routing(plain, routes):
        pass
    dense = json.loads((Path(tiny_dense_path) / "config.json").read_text())
    with pytest.raises(ValueError, match="dense"):
        build_model(dense, parallel.Layout(), routing_replay=True)
    with replay_routing(ours, None):  # None: no replay, like replaying()
        pass


def grads_after(model, steps) -> dict[str, torch.Tensor]:
    """Run ``steps`` (each returns a loss, or a backward to run later) and the gradients they leave."""
    model.zero_grad(set_to_none=True)
    for step in steps:
        step()
    return {name: p.grad.clone() for name, p in model.gpt.named_parameters() if p.grad is not None}


def test_recomputed_layers_route_in_the_backward_as_their_forward_did(tiny_moe_path, models):
    ours, _ = models
    config = json.loads((Path(tiny_moe_path) / "config.json").read_text())
    recomputing = build_model(config, parallel.Layout(), routing_replay=True, recompute=True)
    convert.load_hf_checkpoint(recomputing, tiny_moe_path)
    ids, mask = batch(400)
    layout = routing_layout(ours)
    first = random_routes(ids, layout.num_layers, layout.top_k, layout.num_experts)
    second = first.roll(1, dims=-1)  # other experts, same validity

    def two_micro_batches(model):
        losses = []
        for routes in (first, second):  # both forwards before either backward, each replay over by then
            with replay_routing(model, routes):
                losses.append(model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)[..., 5].sum())
        return [lambda: losses[0].backward(), lambda: losses[1].backward()]

    expected = grads_after(ours, two_micro_batches(ours))
    recomputed = grads_after(recomputing, two_micro_batches(recomputing))
    assert expected.keys() == recomputed.keys() and len(expected) > 10
    for name, grad in expected.items():
        assert torch.allclose(recomputed[name], grad, atol=1e-5), name


def test_packed_segments_give_each_samples_own_logits(models):
    ours, _ = models
    ids, mask = batch(400)
    lengths = mask.sum(dim=1).tolist()
    packed = torch.cat([ids[row, :n] for row, n in enumerate(lengths)]).unsqueeze(0)
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).unsqueeze(0)
    with torch.no_grad():
        padded = ours(input_ids=ids, attention_mask=mask).logits
        together = ours(packed, segment_ids=segments).logits[0]
    assert (together - padded[mask.bool()]).abs().max().item() < 1e-5
