"""FSDP2 across two gloo processes gives the same update as one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.ranks_helper import run_ranks

WORKER = "tests.trainer.fsdp_worker"


def train_on_ranks(model_path: str, world_size: int, out_dir: Path, options: dict | None = None) -> dict:
    out_dir.mkdir()
    run_ranks(WORKER, world_size, [model_path, str(out_dir / "adapter.pt"), json.dumps(options or {})], timeout=240)
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    return torch.load(out_dir / "adapter.pt")


@pytest.mark.slow
def test_two_rank_fsdp2_step_matches_the_single_process_step(tiny_model_path, tmp_path):
    sharded = train_on_ranks(tiny_model_path, 2, tmp_path / "two")
    single = train_on_ranks(tiny_model_path, 1, tmp_path / "one")
    assert sharded["step"] == single["step"] == 1
    for name, tensor in single["adapter"].items():
        assert torch.allclose(sharded["adapter"][name], tensor, atol=1e-5), name


@pytest.mark.slow
def test_two_rank_step_with_per_token_loss_token_budget_and_whitened_advantages_matches_one_process(
    tiny_model_path, tmp_path
):
    # Rank 0 holds samples of 9 and 10 tokens (7 trained), rank 1 of 9 and 8 (5 trained): the per-token normalizer,
    # the micro-batch count (2 bins of 17 tokens against 1) and the REINFORCE++ whitening statistics all need the
    # other rank's share.
    options = {
        "per_token_loss": True,
        "max_tokens_per_micro_batch": 17,
        "recompute": True,
        "responses": [[70, 71, 2], [90, 91, 2], [70, 71, 72, 2], [91, 2]],
        "algorithm": {"advantage_estimator": "reinforce_plus_plus"},
    }
    sharded = train_on_ranks(tiny_model_path, 2, tmp_path / "two", options)
    single = train_on_ranks(tiny_model_path, 1, tmp_path / "one", options)
    for name, tensor in single["adapter"].items():
        assert torch.allclose(sharded["adapter"][name], tensor, atol=1e-5), name
