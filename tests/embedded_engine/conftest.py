"""Shared fixtures: the tiny models, LoRA adapters for them, and real engine processes on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_runner.models.tiny_model import ensure_tiny_model

from .server_process import EngineProcess, start_engine

MAX_LORA_RANK = 8
MLA_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    return ensure_tiny_model("tiny-moe")


@pytest.fixture(scope="session")
def tiny_dense_dir() -> Path:
    return ensure_tiny_model("tiny-dense")


@pytest.fixture(scope="session")
def tiny_glm5_dir() -> Path:
    return ensure_tiny_model("tiny-glm5")


def _save_adapter(model_dir: Path, out: Path, seed: int, **lora_kwargs) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Random (not zero) B matrices, so the adapter visibly changes the output.
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **lora_kwargs))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def adapter_dirs(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three real peft adapters for the tiny MoE: two on attention, one on the experts' parameters."""
    root = tmp_path_factory.mktemp("adapters")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    return {
        "attn_a": _save_adapter(tiny_moe_dir, root / "attn_a", 1, r=4, lora_alpha=16, target_modules=attention),
        "attn_b": _save_adapter(tiny_moe_dir, root / "attn_b", 2, r=8, lora_alpha=16, target_modules=["q_proj"]),
        "experts": _save_adapter(
            tiny_moe_dir,
            root / "experts",
            3,
            r=4,
            lora_alpha=16,
            target_modules=[],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        ),
        "too_big": _save_adapter(tiny_moe_dir, root / "too_big", 4, r=16, lora_alpha=16, target_modules=["q_proj"]),
    }


@pytest.fixture(scope="session")
def glm5_adapter_dir(tiny_glm5_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real peft adapter for the tiny GLM-5 on every MLA linear."""
    out = tmp_path_factory.mktemp("glm5_adapter") / "mla"
    return _save_adapter(tiny_glm5_dir, out, 5, r=4, lora_alpha=16, target_modules=list(MLA_TARGETS))


@pytest.fixture(scope="session")
def engine(tiny_moe_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory) -> Iterator[EngineProcess]:
    """The shared engine: tiny MoE, LoRA on (attn_a loaded at startup), routed experts on."""
    process = start_engine(
        tiny_moe_dir,
        tmp_path_factory.mktemp("engine") / "engine.log",
        "--enable-lora",
        "--lora-paths",
        f"attn_a={adapter_dirs['attn_a']}",
        "--max-loras-per-batch",
        "4",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--enable-return-routed-experts",
        "--random-seed",
        "7",
        "--tp-size",
        "1",
        "--mem-fraction-static",
        "0.5",  # SGLang flags that are accepted and ignored
    )
    yield process
    process.stop()


@pytest.fixture(scope="session")
def plain_engine(tiny_dense_dir: Path, tmp_path_factory) -> Iterator[EngineProcess]:
    """A second engine with defaults only: dense model, no LoRA, no routed experts."""
    process = start_engine(tiny_dense_dir, tmp_path_factory.mktemp("plain") / "engine.log")
    yield process
    process.stop()


@pytest.fixture()
async def client(engine: EngineProcess) -> httpx.AsyncClient:
    async with httpx.AsyncClient(base_url=engine.url, timeout=60.0) as http:
        yield http


@pytest.fixture()
async def plain_client(plain_engine: EngineProcess) -> httpx.AsyncClient:
    async with httpx.AsyncClient(base_url=plain_engine.url, timeout=60.0) as http:
        yield http
