"""The Megatron trainer on two gloo processes takes the same step as on one: data parallel (each rank half the
batch), and TP=2 + EP=2 with sequence parallelism (both ranks the whole batch)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.ranks_helper import run_ranks

from .test_trainer import megatron, samples, settings_from

pytestmark = pytest.mark.integration

WORKER = "tests.trainer.megatron.trainer_worker"


@pytest.fixture(scope="module")
def one_process(tiny_model_path, start_adapter):
    trainer = megatron(tiny_model_path, settings_from(start_adapter))
    metrics = trainer.train(samples())
    return trainer.adapter_state(), metrics


@pytest.mark.parametrize("layout", [{}, {"tp": 2, "ep": 2, "sp": True}], ids=["dp2", "tp2-ep2-sp"])
def test_two_ranks_take_the_one_process_step(tiny_model_path, start_adapter, one_process, layout, tmp_path):
    out = tmp_path / "rank0.pt"
    run_ranks(WORKER, 2, [tiny_model_path, start_adapter, json.dumps(layout), "thd", out], timeout=240)
    two = torch.load(out)
    adapter, metrics = one_process
    assert set(two["adapter"]) == set(adapter)
    for name, tensor in adapter.items():
        assert torch.allclose(two["adapter"][name], tensor, atol=1e-6), name
    assert two["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-5)
    if not layout:  # data parallel: each rank's loss is its half's (as the FSDP trainer reports it)
        return
    assert two["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-7)
