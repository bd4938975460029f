"""Raw LoRA across two gloo processes: one SGD step from the same seed and data gives the same adapter (PEFT
export), the same gradients and the same gradient norm at TP=2 (dense, with and without sequence parallelism),
EP=2 (MoE, two data-parallel ranks, each its half of the batch) and TP=2+EP=2+SP (MoE) as in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.ranks_helper import run_ranks

pytestmark = pytest.mark.integration

WORKER = "tests.trainer.megatron.raw_lora_worker"
TWO_RANK_CASES = [
    {"name": "dense_tp2_sp", "model": "tiny-dense", "layout": {"tp": 2, "sp": True}},
    {"name": "dense_tp2", "model": "tiny-dense", "layout": {"tp": 2}},
    {"name": "moe_ep2", "model": "tiny-moe", "layout": {"ep": 2}},
    {"name": "moe_tp2_ep2_sp", "model": "tiny-moe", "layout": {"tp": 2, "ep": 2, "sp": True}},
]
ONE_RANK_CASES = [
    {"name": "tiny-dense", "model": "tiny-dense", "layout": {}},
    {"name": "tiny-moe", "model": "tiny-moe", "layout": {}},
]


def run_cases(world_size: int, cases: list[dict], out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    run_ranks(WORKER, world_size, [str(out_dir), json.dumps(cases)], timeout=300)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world_size)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[list[dict], dict]:
    root = tmp_path_factory.mktemp("raw_lora")
    two = run_cases(2, TWO_RANK_CASES, root / "two")
    (one,) = run_cases(1, ONE_RANK_CASES, root / "one")
    return two, one


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("case", TWO_RANK_CASES, ids=[c["name"] for c in TWO_RANK_CASES])
def test_two_rank_step_matches_one_process(results, case):
    two, one = results
    reference = one[case["model"]]
    for rank_result in two:
        got = rank_result[case["name"]]
        assert max_diff(got["start"], reference["start"]) == 0.0  # the same init and start, whatever the layout
        grads = {k: got["start"][k] - got["after"][k] for k in got["start"]}
        reference_grads = {k: reference["start"][k] - reference["after"][k] for k in reference["start"]}
        assert max(float(g.abs().max()) for g in reference_grads.values()) > 1e-3  # a real step, far above 1e-6
        assert max_diff(got["after"], reference["after"]) < 1e-6
        assert max_diff(grads, reference_grads) < 1e-6
        assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
