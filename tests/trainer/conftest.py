"""Shared fixtures: the cached tiny MoE model (built once, then cached under .cache/models)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from miles_runner.models.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model("tiny-moe"))
