"""lora_mode=bridge across two gloo processes. Every supported layout -- dense TP=2 (with and without sequence
parallelism), dense DP=2, MoE TP=2+SP (also under routing replay: each rank's routers replay their sequence
shard), and MoE EP=2 (two data-parallel ranks) with attention targets -- gives the same initial adapter from the
same seed, the same trained adapter after two SGD steps on the same batch (each DP rank its rows) and the same
save_hf_adapter files as one process.

MoE EP=2 with expert targets: Bridge's export is broken (what bridge.EXPERT_EXPORT_REFUSAL says): each EP rank's
local experts are numbered from 0, so the file holds half the experts and peft cannot load it. When a
Megatron-Bridge release fixes that, test_ep2_expert_export_is_broken fails: lift the refusal then."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tests.trainer.ranks_helper import run_ranks

from .bridge_case import ATTENTION_TARGETS, batch

WORKER = "tests.trainer.megatron.bridge.bridge_worker"
PARITY_CASES = [  # (case, the one_rank reference)
    ({"name": "dense_tp2", "model": "tiny-dense", "layout": {"tp": 2}}, "tiny-dense"),
    ({"name": "dense_tp2_sp", "model": "tiny-dense", "layout": {"tp": 2, "sp": True}}, "tiny-dense"),
    ({"name": "dense_dp2", "model": "tiny-dense", "layout": {}}, "tiny-dense"),
    ({"name": "moe_tp2_sp", "model": "tiny-moe", "layout": {"tp": 2, "sp": True}}, "tiny-moe"),
    (
        {
            "name": "moe_ep2_attention",
            "model": "tiny-moe",
            "layout": {"ep": 2},
            "options": {"targets": ATTENTION_TARGETS},
        },
        "tiny-moe-attention",
    ),
    (
        {
            "name": "moe_tp2_sp_replay",
            "model": "tiny-moe",
            "layout": {"tp": 2, "sp": True},
            "options": {"replay": True},
        },
        "tiny-moe-replay",
    ),
]


def run_two_ranks(out_dir: Path, cases: list[dict], paths: dict[str, str]) -> list[dict]:
    out_dir.mkdir()
    cases = [{**case, "model": paths[case["model"]]} for case in cases]
    run_ranks(WORKER, 2, [str(out_dir), json.dumps(cases)], timeout=300)
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


@pytest.fixture(scope="module")
def model_paths(tiny_dense_path, tiny_moe_path) -> dict[str, str]:
    return {"tiny-dense": tiny_dense_path, "tiny-moe": tiny_moe_path}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, model_paths) -> tuple[Path, list[dict]]:
    out_dir = tmp_path_factory.mktemp("bridge_two_ranks") / "out"
    return out_dir, run_two_ranks(out_dir, [case for case, _ in PARITY_CASES], model_paths)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "reference_name"), PARITY_CASES, ids=[case["name"] for case, _ in PARITY_CASES])
def test_two_ranks_train_and_export_the_adapter_of_one_process(two_ranks, one_rank, case, reference_name):
    from safetensors.torch import load_file

    out_dir, ranks = two_ranks
    reference = one_rank[reference_name]
    for rank in ranks:
        got = rank[case["name"]]
        assert max_diff(got["start"], reference["start"]) == 0.0  # the same init whatever the layout
        assert max_diff(got["after"], reference["after"]) < 1e-6  # measured 6e-8 to 2.5e-7
        assert max_diff(got["after"], got["start"]) > 1e-2
    # each rank's loss is its DP share times the DP size: their mean is the whole batch's
    losses = torch.tensor([rank[case["name"]]["losses"] for rank in ranks]).mean(0)
    assert losses.tolist() == pytest.approx(reference["losses"], rel=1e-5)
    exported = out_dir / case["name"]
    one_process = Path(reference["export_dir"])
    assert (
        max_diff(
            load_file(exported / "adapter_model.safetensors"), load_file(one_process / "adapter_model.safetensors")
        )
        < 1e-6
    )
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config == json.loads((one_process / "adapter_config.json").read_text())


def expert_indices(state: dict[str, torch.Tensor]) -> set[int]:
    return {int(m.group(1)) for name in state if (m := re.search(r"\.experts\.(\d+)\.", name))}


@pytest.mark.slow
def test_ep2_expert_export_is_broken(tmp_path, one_rank, model_paths):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    case = {"name": "moe_ep2", "model": "tiny-moe", "layout": {"ep": 2}, "options": {"allow_expert_ep": True}}
    ranks = [rank["moe_ep2"] for rank in run_two_ranks(tmp_path / "two", [case], model_paths)]
    assert expert_indices(one_rank["tiny-moe"]["after"]) == set(range(8))
    export = tmp_path / "two" / "moe_ep2"
    written = load_file(export / "adapter_model.safetensors")
    # Each rank exported its 4 local experts as experts 0-3: experts 4-7 have no adapter in the file.
    assert expert_indices(written) == expert_indices(ranks[0]["after"]) == {0, 1, 2, 3}
    hf = AutoModelForCausalLM.from_pretrained(model_paths["tiny-moe"], dtype=torch.float32)
    with pytest.raises(RuntimeError, match="size mismatch"):
        PeftModel.from_pretrained(hf, str(export))
    _, mask = batch(ranks[0]["logits"].shape[-1])
    assert float((ranks[0]["logits"] - ranks[0]["initial_logits"])[mask.bool()].abs().max()) > 1e-2  # it trained
