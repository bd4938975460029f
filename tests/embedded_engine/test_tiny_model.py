"""The tiny model factory: deterministic, complete HF folders, cached and rebuilt when incomplete."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from miles_runner.models.tiny_model import COMPLETE_MARKER, build_tiny_model, ensure_tiny_model, main


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_same_seed_builds_byte_identical_folders(tmp_path, tiny_moe_dir):
    rebuilt = build_tiny_model(tmp_path / "again", seed=0)
    assert _digest(rebuilt) == _digest(tiny_moe_dir)


def test_another_seed_gives_other_weights_and_the_same_tokenizer(tmp_path, tiny_moe_dir):
    other = _digest(build_tiny_model(tmp_path / "seed1", seed=1))
    base = _digest(tiny_moe_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


def test_moe_config_describes_the_routing_shape(tiny_moe_dir):
    config = json.loads((tiny_moe_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert (config["num_hidden_layers"], config["num_experts_per_tok"], config["num_local_experts"]) == (2, 2, 8)
    assert config["initializer_range"] == 0.1


def test_dense_model_is_a_plain_qwen3(tiny_dense_dir):
    config = json.loads((tiny_dense_dir / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "num_experts_per_tok" not in config


def test_tokenizer_is_small_and_round_trips_arithmetic_and_chat(tiny_moe_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    assert len(tokenizer) <= 512
    text = "What is 12 + 30? The answer is 42. <answer>42</answer> Ünïcode ✓"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(tokenizer("12 + 30 = 42")["input_ids"]) <= 8  # digits and arithmetic were merged in training


def test_chat_template_ends_with_the_assistant_generation_prompt(tiny_moe_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert with_prompt == without + "<|im_start|>assistant\n"
    assert without == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_ensure_builds_once_then_reuses_the_cache(tmp_path):
    first = ensure_tiny_model("tiny-dense", cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model("tiny-dense", cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name == "tiny-dense-seed0"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-dense-seed0"]  # no staging folder left behind


def test_ensure_rebuilds_an_incomplete_folder(tmp_path):
    folder = tmp_path / "tiny-moe-seed0"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # a crash mid-write, no completion marker
    assert ensure_tiny_model("tiny-moe", cache_dir=tmp_path) == folder
    assert (folder / COMPLETE_MARKER).is_file() and (folder / "model.safetensors").is_file()


def test_ensure_rejects_an_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="tiny-moe"):
        ensure_tiny_model("huge", cache_dir=tmp_path)


def test_cli_writes_a_model_folder(tmp_path, capsys):
    main([str(tmp_path / "cli"), "--dense", "--seed", "3"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli")
    assert json.loads((tmp_path / "cli" / COMPLETE_MARKER).read_text())["seed"] == 3


def test_glm5_has_the_shape_the_plan_checks_and_loads_in_every_transformers_version():
    from miles_runner.core.tiny_shapes import TINY_SHAPES

    folder = ensure_tiny_model("tiny-glm5")
    config = json.loads((folder / "config.json").read_text())
    assert {key: config[key] for key in TINY_SHAPES["tiny-glm5"]} == TINY_SHAPES["tiny-glm5"]
    assert config["index_topk"] >= config["max_position_embeddings"]  # the indexer never drops a token
    # Read alike by transformers 5.12 (Megatron-Bridge's) and newer: one expert count, each its own layer type name.
    assert config["num_experts"] == config["n_routed_experts"] and config["layer_types"] is None
    assert json.loads((folder / COMPLETE_MARKER).read_text())["name"] == "tiny-glm5"


def test_older_markers_without_a_name_still_mark_their_model_complete(tiny_moe_dir, tiny_dense_dir):
    for folder in (tiny_moe_dir, tiny_dense_dir):
        assert "name" not in json.loads((folder / COMPLETE_MARKER).read_text())
        stamp = (folder / "model.safetensors").stat().st_mtime_ns
        assert ensure_tiny_model(folder.name.removesuffix("-seed0"), cache_dir=folder.parent) == folder
        assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
