"""lora_mode=bridge on tiny-glm5 (GLM-5's architecture: MLA attention with a DSA indexer, a shared expert), in one
process: Bridge builds it on CPU with bridge_compat's local DSA attention and gives the HF model's logits; LoRA on the
five MLA linears trains, and the adapter save_hf_adapter writes loads in peft.PeftModel with the Bridge logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_runner.trainer.megatron.parallel import Layout

from .bridge_case import batch, run_case
from .test_bridge_lora import TOLERANCE, hf_model, valid_diff

MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> tuple[str, dict]:
    from miles_runner.models.tiny_model import ensure_tiny_model

    path = str(ensure_tiny_model("tiny-glm5"))
    return path, run_case(path, Layout(), tmp_path_factory.mktemp("glm5") / "adapter", MLA_TARGETS)


def test_bridge_builds_dsa_attention_and_gives_the_hf_logits(glm5):
    path, result = glm5
    ids, mask = batch(result["logits"].shape[-1])
    with torch.no_grad():
        expected = hf_model(path)(input_ids=ids, attention_mask=mask).logits
    assert valid_diff(result["initial_logits"], expected, mask) < TOLERANCE  # measured 2e-6


def test_packed_samples_each_read_only_their_own_tokens(glm5):
    """thd packing puts several samples in a row; the DSA attention (and its indexer) must keep each to itself."""
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.megatron.bridge import build_bridge_gpt
    from miles_runner.trainer.megatron.model import MegatronCausalLM

    path, _ = glm5
    parallel.initialize(Layout())
    _, gpt, _ = build_bridge_gpt(path, Layout())
    model = MegatronCausalLM(gpt, json.loads((Path(path) / "config.json").read_text()), Layout(), False).eval()
    first, second = torch.tensor([[1, 60, 61, 62, 63, 4, 70, 71]]), torch.tensor([[5, 9, 11, 13, 90, 91]])
    segments = torch.tensor([[0] * first.shape[1] + [1] * second.shape[1]])
    with torch.no_grad():
        packed = model(torch.cat([first, second], dim=1), segment_ids=segments).logits
        alone = torch.cat([model(first).logits, model(second).logits], dim=1)
    assert float((packed - alone).abs().max()) < TOLERANCE  # without the given mask: 3.8 on the second sample


def test_lora_on_the_mla_linears_trains_every_adapter_tensor(glm5):
    _, result = glm5
    first, second = result["losses"]
    assert second < first - 0.1
    moved = {name: float((result["after"][name] - result["start"][name]).abs().max()) for name in result["start"]}
    assert min(moved.values()) > 1e-4, moved
    modules = {name.split(".self_attn.")[1].split(".lora_")[0] for name in moved}
    assert modules == set(MLA_TARGETS) and len(moved) == 2 * 2 * len(MLA_TARGETS)  # 2 layers, A and B


def token_log_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_save_hf_adapter_loads_in_peft_with_the_bridge_log_probs(glm5):
    from peft import PeftModel

    path, result = glm5
    ids, mask = batch(result["logits"].shape[-1])
    config = json.loads((Path(result["export_dir"]) / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(MLA_TARGETS)
    peft_model = PeftModel.from_pretrained(hf_model(path), result["export_dir"]).eval()
    with torch.no_grad():
        logits = peft_model(input_ids=ids, attention_mask=mask).logits
    assert valid_diff(logits, result["logits"], mask) < TOLERANCE  # measured 1e-6
    scored = mask[:, 1:] * mask[:, :-1]
    peft_lp, bridge_lp = token_log_probs(logits, ids), token_log_probs(result["logits"], ids)
    assert valid_diff(peft_lp, bridge_lp, scored) < TOLERANCE
    assert valid_diff(logits, result["initial_logits"], mask) > 1e-2  # the adapter is in effect
    assert valid_diff(result["disabled_logits"], result["initial_logits"], mask) == 0.0
