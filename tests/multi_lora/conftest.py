"""Shared fixtures: one embedded engine for the multi-LoRA tests, with two adapter slots loaded."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_testkit.contract import build_contract_adapter
from miles_testkit.launch import embedded_engine_argv, start_engine


@pytest.fixture(scope="session")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tiny MoE engine on 127.0.0.1 with `__miles_slot_0` and `__miles_slot_1` holding one test adapter."""
    model_dir = ensure_tiny_model("tiny-moe")
    adapter = build_contract_adapter(model_dir, tmp_path_factory.mktemp("adapter") / "lora")
    port = free_port()
    argv = embedded_engine_argv(
        model_dir,
        port,
        "--enable-lora",
        "--max-loras-per-batch",
        "2",
        "--lora-paths",
        f"__miles_slot_0={adapter}",
        f"__miles_slot_1={adapter}",
    )
    engine = start_engine(argv, port=port, log_path=tmp_path_factory.mktemp("logs") / "engine.log", timeout_s=180)
    yield f"http://{LOOPBACK}:{port}"
    engine.stop()
