"""Shared fixtures of the megatron tests: the cached tiny HF models (built once, then cached under .cache/models).

Two-process tests use ranks_helper.run_ranks; parity_case.run_case is the one computation that the single-process
reference (here) and each rank of a worker run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_runner.models.tiny_model import ensure_tiny_model

from .fused_adapter import save_fused_adapter


@pytest.fixture(scope="session")
def tiny_moe_path() -> str:
    return str(ensure_tiny_model("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_dense_path() -> str:
    return str(ensure_tiny_model("tiny-dense"))


@pytest.fixture(scope="session")
def start_adapter(tiny_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT adapter with random A and B (q/k/v sharing A, as megatron's fused linear_qkv): both trainers start
    from it."""
    return save_fused_adapter(tiny_model_path, tmp_path_factory.mktemp("start") / "adapter")


@pytest.fixture(scope="module", autouse=True)
def no_world_left_behind():
    """A trainer built in this process creates a one-rank torch.distributed world (parallel.initialize); end it
    after each module, or the next test that makes its own process group (trainer/ranks.py) would find one."""
    yield
    from miles_runner.trainer.megatron import parallel

    parallel.destroy()
