"""A real embedded engine (LoRA on, short --dist-timeout), plans for both sync topologies, and peft adapters
for the tiny MoE: each as the trainer would hand it over (config dict + tensors) and saved on disk."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import EngineClient
from miles_testkit.launch import embedded_engine_argv, engine_url, start_engine

DIST_TIMEOUT_S = 5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class Adapter:
    config: dict
    tensors: dict  # PEFT names -> tensors, as the trainer exports them
    path: Path  # the same adapter saved by peft


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    return ensure_tiny_model("tiny-moe")


def _make_adapter(model_dir: Path, out: Path, seed: int) -> Adapter:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Random (not zero) B matrices, so the adapter visibly changes the output.
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=16, target_modules=ATTENTION, init_lora_weights=False))
    model.save_pretrained(out)
    config = json.loads((out / "adapter_config.json").read_text())
    return Adapter(config, load_file(out / "adapter_model.safetensors"), out)


@pytest.fixture(scope="session")
def adapters(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Adapter, Adapter]:
    """Two adapters of the same shape (two training steps of one adapter, as far as the engine can tell)."""
    root = tmp_path_factory.mktemp("lora_sync_adapters")
    return _make_adapter(tiny_moe_dir, root / "first", 11), _make_adapter(tiny_moe_dir, root / "second", 12)


def lora_engine(tiny_moe_dir: Path, log_dir: Path) -> Iterator[str]:
    """A LoRA-enabled embedded engine for sync tests: yields its URL, stops it after."""
    port = free_port()
    argv = embedded_engine_argv(
        tiny_moe_dir, port, "--enable-lora", "--max-lora-rank", "8", "--dist-timeout", str(DIST_TIMEOUT_S)
    )
    process = start_engine(argv, port=port, log_path=log_dir / "engine.log", env={"HF_HUB_OFFLINE": "1"}, timeout_s=180)
    yield engine_url(argv, port)
    process.stop()


@pytest.fixture(scope="session")
def engine_url_for_sync(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from lora_engine(tiny_moe_dir, tmp_path_factory.mktemp("lora_sync_engine"))


@pytest.fixture()
async def client(engine_url_for_sync: str) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine_url_for_sync, timeout_s=60) as engine_client:
        yield engine_client


def _plan(*overrides: str) -> Plan:
    from miles_runner.config.compose import compose
    from miles_runner.plan.compile import compile_plan

    return compile_plan(compose(list(overrides)))


DISAGGREGATED = ("topology=disaggregated", "topology.rollout_num_gpus=1", "topology.actor_num_gpus_per_node=1")


@pytest.fixture(scope="session")
def colocated_plan() -> Plan:
    """The default plan: colocated, tensor sync, pause mode retract, flush always."""
    return _plan()


@pytest.fixture(scope="session")
def disaggregated_plan() -> Plan:
    """Broadcast sync on a CPU cluster (gloo), pause mode retract, flush."""
    return _plan(*DISAGGREGATED)


@pytest.fixture(scope="session")
def in_place_plan() -> Plan:
    """Broadcast sync with pause mode in_place: no flush, requests keep their KV cache across the sync."""
    return _plan(*DISAGGREGATED, "pause_generation_mode=in_place")
