"""Raw LoRA on the megatron model in one process (TP=1): it computes what the HF model with peft computes from
its PEFT export (experts included), the embedded engine serves that export with the same log-probs, the reference
context gives the base, and the export/load round trip is exact and strict."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.convert import load_hf_checkpoint
from miles_runner.trainer.megatron.model import build_model

from .raw_lora_worker import TARGETS, adapter_spec, nonzero_start

pytestmark = pytest.mark.integration

IDS = torch.randint(3, 400, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module", autouse=True)
def one_rank_world() -> Iterator[None]:
    parallel.initialize(parallel.Layout())
    yield
    parallel.destroy()


def megatron_model(name: str, targets: list[str] | None = None, *, start: bool = True):
    """The megatron model of a tiny HF folder with raw LoRA attached (and, with ``start``, non-zero B)."""
    folder = ensure_tiny_model(name)
    model = build_model(json.loads((folder / "config.json").read_text()), parallel.Layout())
    load_hf_checkpoint(model, str(folder))
    adapter = adapter_spec(targets=targets)
    raw_lora.attach_lora(model, adapter, seed=1)
    if start:
        lora_export.load_peft_state(model, nonzero_start(lora_export.export_peft_state(model)))
    return model, adapter, folder


def logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def save_peft_folder(model, adapter, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    save_file(lora_export.export_peft_state(model), out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(lora_export.peft_adapter_config(model, adapter)))
    return out


@pytest.mark.parametrize("name", ["tiny-moe", "tiny-dense"])
def test_lora_logits_match_hf_with_peft_loaded_from_the_export(name, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, adapter, folder = megatron_model(name)
    peft_dir = save_peft_folder(model, adapter, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_base = logits(base)
    hf_lora = logits(PeftModel.from_pretrained(base, peft_dir).eval())
    assert (hf_lora - hf_base).abs().max() > 0.1  # the adapter matters, experts included
    assert (logits(model) - hf_lora).abs().max() < 1e-5


def test_moe_export_targets_the_fused_expert_parameters_as_peft_does():
    model, adapter, _ = megatron_model("tiny-moe", start=False)
    config = lora_export.peft_adapter_config(model, adapter)
    assert config["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    state = lora_export.export_peft_state(model)
    experts = "base_model.model.model.layers.0.mlp.experts"
    assert state[f"{experts}.base_layer.lora_A.weight"].shape == (8 * 4, 64)  # gate_up_proj: E*r x hidden
    assert state[f"{experts}.base_layer.lora_B.weight"].shape == (2 * 64, 4 * 8)
    assert state[f"{experts}.lora_B.weight"].shape == (64, 4 * 8)  # down_proj


def test_fresh_adapter_is_kaiming_a_and_zero_b_with_fused_modules_sharing_a():
    model, _, _ = megatron_model("tiny-dense", start=False)
    with raw_lora.disabled(model):
        base = logits(model)
    assert torch.equal(logits(model), base)  # B = 0: the fresh adapter changes nothing
    state = lora_export.export_peft_state(model)
    attn = "base_model.model.model.layers.0.self_attn"
    q_a = state[f"{attn}.q_proj.lora_A.weight"]
    for shared in ("k_proj", "v_proj"):
        assert torch.equal(q_a, state[f"{attn}.{shared}.lora_A.weight"])
    assert not torch.equal(q_a, state[f"{attn}.o_proj.lora_A.weight"])
    assert 0.5 / math.sqrt(64) < q_a.abs().max() <= 1 / math.sqrt(64)  # peft's kaiming_uniform(a=sqrt(5)) bound
    again, _, _ = megatron_model("tiny-dense", start=False)
    assert lora_export.export_peft_state(again).keys() == state.keys()
    assert all(torch.equal(lora_export.export_peft_state(again)[k], v) for k, v in state.items())  # seeded


def test_disabled_gives_the_base_logits_and_restores_the_adapter():
    model, _, folder = megatron_model("tiny-moe")
    with_lora = logits(model)
    plain = build_model(json.loads((folder / "config.json").read_text()), parallel.Layout())
    load_hf_checkpoint(plain, str(folder))
    with raw_lora.disabled(model):
        assert torch.equal(logits(model), logits(plain))
    assert torch.equal(logits(model), with_lora)
    with raw_lora.enabled(model, False):
        assert torch.equal(logits(model), logits(plain))


def test_only_lora_parameters_train():
    model, _, _ = megatron_model("tiny-moe", start=False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("lora_adapters.") for n in trainable)
    assert {id(p) for p in raw_lora.lora_parameters(model)} == {id(p) for p in model.parameters() if p.requires_grad}


def test_load_export_round_trip_is_exact():
    model, _, _ = megatron_model("tiny-moe")
    state = lora_export.export_peft_state(model)
    other, _, _ = megatron_model("tiny-moe", start=False)
    lora_export.load_peft_state(other, state)
    assert all(torch.equal(lora_export.export_peft_state(other)[k], v) for k, v in state.items())
    assert torch.equal(logits(other), logits(model))


def _bad(state: dict[str, torch.Tensor], kind: str) -> tuple[dict[str, torch.Tensor], str]:
    attn = "base_model.model.model.layers.1.self_attn"
    state = dict(state)
    if kind == "missing":
        del state[f"{attn}.o_proj.lora_B.weight"]
        return state, f"{attn}.o_proj.lora_B.weight"
    if kind == "unexpected":
        state[f"{attn}.q_norm.lora_A.weight"] = torch.zeros(4, 16)
        return state, f"{attn}.q_norm.lora_A.weight"
    if kind == "shape":
        state[f"{attn}.k_proj.lora_B.weight"] = torch.zeros(32, 8)
        return state, f"{attn}.k_proj.lora_B.weight"
    state[f"{attn}.v_proj.lora_A.weight"] = state[f"{attn}.v_proj.lora_A.weight"] + 1
    return state, f"{attn}.v_proj.lora_A.weight"


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape", "unshared_fused_a"])
def test_a_state_that_does_not_fit_is_refused_naming_the_tensor(kind):
    model, _, _ = megatron_model("tiny-moe")
    before = lora_export.export_peft_state(model)
    bad, name = _bad(before, kind)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        lora_export.load_peft_state(model, bad)
    assert all(torch.equal(lora_export.export_peft_state(model)[k], v) for k, v in before.items())  # untouched


@pytest.mark.parametrize(
    ("targets", "message"),
    [(["q_proj", "v_proj"], r"k_proj"), (["gate_proj", "down_proj"], r"up_proj"), (["q_proj", "lm_head"], "lm_head")],
)
def test_targets_megatron_cannot_hold_are_refused(targets, message):
    with pytest.raises(ValueError, match=message):
        raw_lora.megatron_targets(targets)


def test_mla_targets_map_for_bridge_but_raw_lora_refuses_them():
    mla = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
    assert raw_lora.megatron_targets(mla) == set(raw_lora.MLA_MODULES)  # Bridge's LoRA names
    with pytest.raises(ValueError, match="lora_mode=raw converts no MLA model"):
        raw_lora.attach_lora(torch.nn.Linear(2, 2), adapter_spec(targets=[*mla, "o_proj"]), seed=0)


def test_attaching_twice_is_refused():
    model, adapter, _ = megatron_model("tiny-dense", start=False)
    with pytest.raises(ValueError, match="already"):
        raw_lora.attach_lora(model, adapter, seed=1)


def test_embedded_engine_serves_the_export_with_the_megatron_log_probs(tmp_path):
    from tests.embedded_engine.server_process import start_engine

    model, adapter, folder = megatron_model("tiny-moe", TARGETS)
    peft_dir = save_peft_folder(model, adapter, tmp_path / "adapter")
    engine = start_engine(folder, tmp_path / "engine.log", "--enable-lora", "--max-lora-rank", "8")
    try:
        with httpx.Client(base_url=engine.url, timeout=60.0) as http:
            loaded = http.post("/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(peft_dir)})
            assert loaded.status_code == 200, loaded.text
            prompt = IDS[0].tolist()
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
                "lora_path": "policy",
                "return_logprob": True,
            }
            reply = http.post("/generate", json=body)
            assert reply.status_code == 200, reply.text
    finally:
        engine.stop()
    served = reply.json()["meta_info"]["output_token_logprobs"]
    tokens = [int(t[1]) for t in served]
    sequence = torch.tensor([prompt + tokens])
    log_probs = torch.log_softmax(logits(model, sequence)[0], dim=-1)
    ours = [float(log_probs[len(prompt) - 1 + i, token]) for i, token in enumerate(tokens)]
    assert [t[0] for t in served] == pytest.approx(ours, abs=1e-4)


def test_clipping_scales_the_lora_gradient_to_the_limit():
    model, _, _ = megatron_model("tiny-moe")
    model(input_ids=IDS, attention_mask=torch.ones_like(IDS)).logits.pow(2).mean().backward()
    raw_lora.reduce_lora_grads(model)
    before = raw_lora.clip_grad_norm(model, 0.1)
    squares = sum(float(p.grad.pow(2).sum()) for p in raw_lora.lora_parameters(model))
    assert before > 0.1 and raw_lora.grad_norm(model) == pytest.approx(0.1, rel=1e-4)
    assert math.sqrt(squares) == pytest.approx(0.1, rel=1e-4)  # one rank: every weight counted once
