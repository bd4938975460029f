"""Shared fixtures of the megatron tests: the cached tiny HF models (built once, then cached under .cache/models).

Two-process tests use ranks_helper.run_ranks; parity_case.run_case is the one computation that the single-process
reference (here) and each rank of a worker run.
"""

from __future__ import annotations

import pytest

from miles_runner.models.tiny_model import ensure_tiny_model


@pytest.fixture(scope="session")
def tiny_moe_path() -> str:
    return str(ensure_tiny_model("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_dense_path() -> str:
    return str(ensure_tiny_model("tiny-dense"))
