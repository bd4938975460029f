"""HF <-> megatron conversion on one process: megatron logits equal the HF model's, the export is bit-exact to the
HF checkpoint, a random Qwen2 (qkv bias) converts both ways, and the fused-row helpers invert each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig

from miles_runner.trainer.megatron import convert, parallel
from miles_runner.trainer.megatron.model import build_model, routing_layout

from .parity_case import REAL, WIDTH, batch

REAL_POSITIONS = torch.tensor([[1] * real + [0] * (WIDTH - real) for real in REAL], dtype=torch.bool)


@pytest.fixture(scope="module")
def megatron_world():
    parallel.initialize(parallel.Layout())
    yield
    parallel.destroy()


def hf_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def loaded(folder: str | Path):
    model = build_model(hf_config(folder), parallel.Layout())
    convert.load_hf_checkpoint(model, folder)
    return model


def logit_diff(megatron_model, hf_model, vocab: int) -> float:
    ids, mask = batch(vocab)
    with torch.no_grad():
        ours = megatron_model(input_ids=ids, attention_mask=mask).logits
        theirs = hf_model(input_ids=ids, attention_mask=mask).logits
    assert ours.shape == theirs.shape
    return (ours - theirs)[REAL_POSITIONS].abs().max().item()


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_megatron_logits_equal_the_hf_model_and_the_export_is_bit_exact(
    megatron_world, name, tiny_moe_path, tiny_dense_path
):
    folder = tiny_moe_path if name == "moe" else tiny_dense_path
    model = loaded(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert logit_diff(model, hf, hf.config.vocab_size) < 1e-5
    exported, checkpoint = convert.export_hf_state(model), load_file(Path(folder) / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    assert all(torch.equal(exported[key], checkpoint[key]) for key in checkpoint)


def random_qwen2(tied: bool) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=1e6,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float()
    with torch.no_grad():  # HF initialises biases and norms to constants: make every tensor tell its place
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_hf_to_megatron(megatron_world, tmp_path, tied):
    hf = random_qwen2(tied)
    hf.save_pretrained(tmp_path)
    model = loaded(tmp_path)
    assert logit_diff(model, hf, 96) < 1e-5
    exported, checkpoint = convert.export_hf_state(model), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    assert all(torch.equal(exported[key], checkpoint[key]) for key in checkpoint)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_megatron_to_hf(megatron_world, tied):
    hf = random_qwen2(tied)
    model = build_model(hf.config.to_dict(), parallel.Layout())
    torch.manual_seed(1)
    with torch.no_grad():  # megatron's own random weights, biases included
        for parameter in model.gpt.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    missing, unexpected = hf.load_state_dict(convert.export_hf_state(model), strict=False)
    assert unexpected == [] and set(missing) <= ({"lm_head.weight"} if tied else set())
    assert logit_diff(model, hf, 96) < 1e-5


def test_a_qwen3_moe_with_a_dense_layer_and_unnormalised_top_k(megatron_world, tmp_path):
    # mlp_only_layers keeps layer 1 dense; norm_topk_prob=False weighs experts by their plain softmax probability
    config = Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    model = loaded(tmp_path)
    assert routing_layout(model).moe_layers == (0,)
    assert logit_diff(model, hf, 96) < 1e-5
    exported, checkpoint = convert.export_hf_state(model), load_file(tmp_path / "model.safetensors")
    assert exported.keys() == checkpoint.keys()
    assert all(torch.equal(exported[key], checkpoint[key]) for key in checkpoint)


def test_an_unknown_model_type_names_the_supported_ones(megatron_world):
    with pytest.raises(ValueError, match=r"'llama'.*qwen2, qwen3, qwen3_moe"):
        build_model({"model_type": "llama", "num_hidden_layers": 2}, parallel.Layout())
    with pytest.raises(ValueError, match=r"supported: qwen2, qwen3, qwen3_moe"):
        convert.hf_module_names("mixtral")


def test_a_checkpoint_missing_or_adding_a_tensor_is_named(megatron_world, tiny_dense_path, tmp_path):
    state = load_file(Path(tiny_dense_path) / "model.safetensors")
    (tmp_path / "config.json").write_text((Path(tiny_dense_path) / "config.json").read_text())
    save_file(
        {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.weight"},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        loaded(tmp_path)
    save_file({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"no place for.*q_proj\.bias"):
        loaded(tmp_path)


def test_fused_rows_split_per_query_group_and_gate_up_halves(tiny_moe_path):
    config = hf_config(tiny_moe_path)  # 4 query heads, 2 KV heads, head_dim 16
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    fused = torch.arange(128.0)[:, None].expand(128, 3)
    parts = convert.split_fused_rows(name, fused, config)
    q, k, v = (parts[f"model.layers.1.self_attn.{p}_proj.weight"][:, 0] for p in "qkv")
    # group 0: q rows 0..31 (heads 0, 1), k 32..47, v 48..63; group 1: q 64..95, k 96..111, v 112..127
    assert q.tolist() == list(range(32)) + list(range(64, 96))
    assert k.tolist() == list(range(32, 48)) + list(range(96, 112))
    assert v.tolist() == list(range(48, 64)) + list(range(112, 128))
    assert torch.equal(convert.fuse_rows(name, parts, config), fused)
    expert = "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1"
    assert convert.hf_names(expert) == [f"model.layers.0.mlp.experts.5.{p}" for p in ("gate_proj", "up_proj")]
    halves = convert.split_fused_rows(expert, torch.arange(8.0), config)
    assert [t.tolist() for t in halves.values()] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_tp_shard_of_linear_fc1_holds_its_part_of_gate_and_of_up():
    full = torch.arange(8.0)  # gate 0..3, up 4..7
    shards = [convert.shard("mlp.linear_fc1.weight", full, rank, 2, 0) for rank in range(2)]
    assert [s.tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert torch.equal(convert.unshard("mlp.linear_fc1.weight", shards, 0), full)
    proj = torch.arange(8.0).reshape(2, 4)  # row-parallel: split along the input dim
    proj_shards = [convert.shard("self_attention.linear_proj.weight", proj, rank, 2, 1) for rank in range(2)]
    assert [s.tolist() for s in proj_shards] == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    assert torch.equal(convert.unshard("self_attention.linear_proj.weight", proj_shards, 1), proj)


def test_the_plan_and_the_trainer_know_the_same_raw_lora_families():
    from miles_runner.core.megatron_families import RAW_LORA_FAMILIES
    from miles_runner.trainer.megatron.convert import CONVERTERS

    assert set(CONVERTERS) == set(RAW_LORA_FAMILIES)
