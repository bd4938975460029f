"""Two gloo processes with TP, EP, expert-TP and SP compute what one process does: the same logits, gradients
(gathered, in HF names) and routing-replay logits, within 1e-5; and the sharded load exports back bit-exact.

One worker launch runs every layout (start-up dominates); each test reads its cases from it. Data parallelism is
real (rows split over the DP ranks, grads summed), see parity_case.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles_runner.trainer.megatron.parallel import Layout
from tests.trainer.ranks_helper import run_ranks

from .parity_case import REAL, WIDTH, run_case

pytestmark = pytest.mark.integration

WORKER = "tests.trainer.megatron.parity_worker"
LAYOUTS = {
    "dense dp2": ("dense", {}),
    "dense tp2": ("dense", {"tp": 2}),
    "dense tp2 sp": ("dense", {"tp": 2, "sp": True}),
    "moe dp2 (expert-dp2)": ("moe", {}),
    "moe ep2": ("moe", {"ep": 2}),
    "moe tp2 ep2 sp": ("moe", {"tp": 2, "ep": 2, "sp": True}),
    "moe tp2 etp2 sp": ("moe", {"tp": 2, "etp": 2, "sp": True}),
}
REAL_POSITIONS = torch.tensor([[1] * real + [0] * (WIDTH - real) for real in REAL], dtype=torch.bool)


@pytest.fixture(scope="module")
def results(tiny_moe_path, tiny_dense_path, tmp_path_factory) -> dict:
    paths = {"moe": tiny_moe_path, "dense": tiny_dense_path}
    out = tmp_path_factory.mktemp("parity") / "results.pt"
    cases = [[name, paths[model], layout] for name, (model, layout) in LAYOUTS.items()]
    run_ranks(WORKER, 2, [out, json.dumps(cases)], timeout=240)
    two = torch.load(out)
    one = {model: run_case(path, Layout()) for model, path in paths.items()}
    return {name: (two[name], one[model]) for name, (model, _) in LAYOUTS.items()}


def max_logit_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b)[REAL_POSITIONS].abs().max().item()


def assert_same(two: dict, one: dict) -> None:
    assert two["inexact"] == one["inexact"] == []  # the gathered export is the checkpoint, bit for bit
    assert max_logit_diff(two["logits"], one["logits"]) < 1e-5
    assert two["grads"].keys() == one["grads"].keys()
    for name, grad in one["grads"].items():
        scale = max(1.0, grad.abs().max().item())
        assert (two["grads"][name] - grad).abs().max().item() < 1e-5 * scale, name


@pytest.mark.parametrize("name", ["dense dp2", "dense tp2", "dense tp2 sp"])
def test_dense_forward_and_backward_match_one_process(results, name):
    assert_same(*results[name])


@pytest.mark.parametrize("name", ["moe dp2 (expert-dp2)", "moe ep2", "moe tp2 ep2 sp", "moe tp2 etp2 sp"])
def test_moe_forward_backward_and_routing_replay_match_one_process(results, name):
    two, one = results[name]
    assert_same(two, one)
    assert max_logit_diff(two["replay_logits"], one["replay_logits"]) < 1e-5
    assert two["replay_counts"] == one["replay_counts"]


def test_the_replayed_routes_change_the_logits(results):
    # The random routes are not the model's own: a replay that silently kept the own routing would pass the
    # parity above, so the replayed logits must differ from the plain ones.
    _, one = results["moe tp2 ep2 sp"]
    assert max_logit_diff(one["replay_logits"], one["logits"]) > 1e-2
    tokens, differing = one["replay_counts"]
    assert tokens == sum(REAL) - len(REAL) - 1  # rows for all tokens but each sample's last, one row left at -1
    assert 0 < differing <= tokens
