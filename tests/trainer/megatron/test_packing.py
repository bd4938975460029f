"""thd packing: samples packed first-fit into bounded rows give the padded rows' logits, with and without routing
replay, however many rows they spread over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_runner.trainer.megatron import packing, parallel
from miles_runner.trainer.megatron.model import build_model
from miles_runner.trainer.megatron.packing import CausalLMForLoss, Packing
from miles_runner.trainer.routing_replay import ReplayStats

from .parity_case import REAL, batch, random_routes


@pytest.fixture(scope="module")
def model(tiny_moe_path):
    from miles_runner.trainer.megatron.convert import load_hf_checkpoint

    parallel.initialize(parallel.Layout())
    ours = build_model(
        json.loads((Path(tiny_moe_path) / "config.json").read_text()), parallel.Layout(), routing_replay=True
    )
    load_hf_checkpoint(ours, tiny_moe_path)
    yield ours
    parallel.destroy()


def logits(model, qkv_format: str, routes=None) -> torch.Tensor:
    ids, mask = batch(400)
    net, stats = CausalLMForLoss(model, qkv_format=qkv_format), ReplayStats()
    with torch.no_grad(), net.replay_routing(routes, stats):
        out = net(ids, mask).logits
    return out * mask[..., None]  # padding positions are never read


def test_samples_spread_over_rows_and_come_back_where_they_were(monkeypatch):
    monkeypatch.setattr(packing, "PACKED_ROW_TOKENS", 8)
    ids, mask = batch(400)
    layout = Packing.of(mask, tp=1)
    assert layout.rows == 2 and layout.width == max(REAL)  # 11 and 7 tokens: one sample per row
    packed = layout.pack(ids, 0)
    assert torch.equal(layout.unpack(packed) * mask, ids * mask)
    assert layout.segments().tolist()[1][: REAL[1]] == [1] * REAL[1]


@pytest.mark.parametrize("row_tokens", [8, 512], ids=["a-row-each", "one-row"])
def test_packed_rows_give_the_padded_rows_logits_with_and_without_replay(model, monkeypatch, row_tokens):
    monkeypatch.setattr(packing, "PACKED_ROW_TOKENS", row_tokens)
    ids, _ = batch(400)
    routes = random_routes(ids, 2, 2, 8)
    assert torch.allclose(logits(model, "thd"), logits(model, "bshd"), atol=1e-5)
    replayed = logits(model, "thd", routes)
    assert torch.allclose(replayed, logits(model, "bshd", routes), atol=1e-5)
    assert not torch.allclose(replayed, logits(model, "thd"), atol=1e-3)  # the replay changed the routing
