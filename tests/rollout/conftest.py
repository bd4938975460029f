"""Shared fixtures: the cached tiny MoE model and its tokenizer (left padding, for batched generation)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    from miles_runner.models.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model("tiny-moe"))


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")
