"""FSDP2 across two gloo processes gives the same update as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_runner.procs.ports import LOOPBACK, free_port

WORKER = Path(__file__).with_name("fsdp_worker.py")


def run_ranks(model_path: str, world_size: int, out_dir: Path, options: dict | None = None) -> dict:
    out_dir.mkdir()
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), model_path, str(out_dir / "adapter.pt"), json.dumps(options or {})],
            env={**os.environ, "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank),
                 "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1"},
        )
        for rank in range(world_size)
    ]
    try:
        codes = [p.wait(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world_size
    assert (out_dir / "adapter" / "adapter_model.safetensors").is_file()
    return torch.load(out_dir / "adapter.pt")


@pytest.mark.slow
def test_two_rank_fsdp2_step_matches_the_single_process_step(tiny_model_path, tmp_path):
    sharded = run_ranks(tiny_model_path, 2, tmp_path / "two")
    single = run_ranks(tiny_model_path, 1, tmp_path / "one")
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
    options = {"per_token_loss": True, "max_tokens_per_micro_batch": 17, "recompute": True,
               "responses": [[70, 71, 2], [90, 91, 2], [70, 71, 72, 2], [91, 2]],
               "algorithm": {"advantage_estimator": "reinforce_plus_plus"}}
    sharded = run_ranks(tiny_model_path, 2, tmp_path / "two", options)
    single = run_ranks(tiny_model_path, 1, tmp_path / "one", options)
    for name, tensor in single["adapter"].items():
        assert torch.allclose(sharded["adapter"][name], tensor, atol=1e-5), name
