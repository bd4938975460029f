"""The model runner's adapter load from tensors (in-process, no server): the received tensors become the
adapter's weights in the engine's dtype, and a refused load leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def runner(tiny_moe_dir: Path):
    from miles_runner.embedded_engine.model_runner import ModelRunner

    return ModelRunner(str(tiny_moe_dir), enable_lora=True, lora_target_modules=ATTENTION)


@pytest.fixture(scope="module")
def adapter(tiny_moe_dir: Path) -> tuple[dict, dict]:
    """(config dict, peft state dict) of a random rank-4 attention adapter, as the trainer hands it over."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False))
    tensors = {name: t.detach().clone() for name, t in get_peft_model_state_dict(model).items()}
    config = model.peft_config["default"].to_dict()
    return {**config, "target_modules": sorted(config["target_modules"])}, tensors


def adapter_weights(runner, name: str) -> dict[str, torch.Tensor]:
    return {key: p for key, p in runner.peft.named_parameters() if f".{name}." in key}


def test_loaded_weights_are_the_tensors_given(runner, adapter):
    from peft import get_peft_model_state_dict

    config, tensors = adapter
    runner.load_adapter_from_tensors("exact", config, tensors)
    try:
        loaded = get_peft_model_state_dict(runner.peft, adapter_name="exact")
        assert set(loaded) == set(tensors) and all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    finally:
        runner.unload_adapter("exact")


def test_bfloat16_tensors_load_in_the_engines_float32(runner, adapter):
    config, tensors = adapter
    runner.load_adapter_from_tensors("bf16", config, {k: t.to(torch.bfloat16) for k, t in tensors.items()})
    try:
        weights = adapter_weights(runner, "bf16")
        assert weights and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in weights.values())
    finally:
        runner.unload_adapter("bf16")


def test_a_refused_load_leaves_no_adapter_and_the_name_free(runner, adapter):
    config, tensors = adapter
    incomplete = dict(list(tensors.items())[1:])
    with pytest.raises(ValueError, match="do not match the config"):
        runner.load_adapter_from_tensors("partial", config, incomplete)
    assert "partial" not in runner.peft.peft_config and not adapter_weights(runner, "partial")
    assert not any(p.is_meta for p in runner.peft.parameters())
    runner.load_adapter_from_tensors("partial", config, tensors)
    runner.unload_adapter("partial")


def state(runner, name: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(runner.peft, adapter_name=name)


def test_a_reload_of_the_same_name_and_config_writes_into_the_unloaded_adapters_weights(runner, adapter):
    config, tensors = adapter
    runner.load_adapter_from_tensors("again", config, {k: t.clone() for k, t in tensors.items()})
    storage = {key: p.data_ptr() for key, p in adapter_weights(runner, "again").items()}
    runner.unload_adapter("again")
    doubled = {k: (2 * t).to(torch.bfloat16) for k, t in tensors.items()}
    runner.load_adapter_from_tensors("again", config, doubled)
    try:
        assert {key: p.data_ptr() for key, p in adapter_weights(runner, "again").items()} == storage  # reused
        loaded = state(runner, "again")
        assert set(loaded) == set(tensors)
        assert all(loaded[k].dtype == torch.float32 and torch.equal(loaded[k], doubled[k].float()) for k in tensors)
    finally:
        runner.unload_adapter("again")


def test_a_receiver_may_write_a_reload_into_the_parked_weights_and_nothing_is_copied(runner, adapter):
    config, tensors = adapter
    shapes = {k: tuple(t.shape) for k, t in tensors.items()}
    fp32 = dict.fromkeys(tensors, torch.float32)
    assert runner.parked_weights("landing", config, shapes, fp32) is None  # nothing parked yet
    runner.load_adapter_from_tensors("landing", config, {k: t.clone() for k, t in tensors.items()})
    assert runner.parked_weights("landing", config, shapes, fp32) is None  # loaded and served: not a landing place
    runner.unload_adapter("landing")
    assert runner.parked_weights("other", config, shapes, fp32) is None
    assert runner.parked_weights("landing", {**config, "lora_alpha": 32}, shapes, fp32) is None
    assert runner.parked_weights("landing", config, shapes, dict.fromkeys(tensors, torch.bfloat16)) is None
    landing = runner.parked_weights("landing", config, shapes, fp32)
    assert landing is not None and set(landing) == set(tensors)
    storage = {key: p.data_ptr() for key, p in adapter_weights(runner, "landing").items()}
    with torch.no_grad():
        for key, weight in landing.items():  # what the broadcast receive does
            weight.copy_(3 * tensors[key])
    runner.load_adapter_from_tensors("landing", config, landing)
    try:
        assert {key: p.data_ptr() for key, p in adapter_weights(runner, "landing").items()} == storage
        loaded = state(runner, "landing")
        assert all(torch.equal(loaded[k], 3 * tensors[k]) for k in tensors)
    finally:
        runner.unload_adapter("landing")


def test_a_reload_with_another_config_builds_the_adapter_afresh(runner, adapter):
    config, tensors = adapter
    runner.load_adapter_from_tensors("rescaled", config, tensors)
    runner.unload_adapter("rescaled")
    runner.load_adapter_from_tensors("rescaled", {**config, "lora_alpha": 32}, tensors)
    try:
        scalings = [m.scaling["rescaled"] for m in runner.peft.modules() if "rescaled" in _dict(m, "scaling")]
        assert scalings and all(s == 32 / config["r"] for s in scalings)
        assert all(torch.equal(state(runner, "rescaled")[k], tensors[k]) for k in tensors)
    finally:
        runner.unload_adapter("rescaled")


def test_an_unloaded_adapter_is_gone_for_every_use_and_any_other_load_deletes_it(runner, adapter, tiny_moe_dir):
    config, tensors = adapter
    runner.load_adapter_from_tensors("parked", config, tensors)
    runner.unload_adapter("parked")
    with pytest.raises(ValueError, match="not loaded"):
        runner.unload_adapter("parked")
    with pytest.raises(ValueError, match="not loaded"):
        runner.replace_adapter_weights("parked", config, tensors)
    runner.load_adapter_from_tensors("other", config, tensors)
    try:
        assert "parked" not in runner.peft.peft_config and not adapter_weights(runner, "parked")
    finally:
        runner.unload_adapter("other")
    assert "other" in runner.peft.peft_config  # parked: the next load decides


def _dict(module, attribute: str) -> dict:
    value = getattr(module, attribute, None)
    return value if isinstance(value, dict) else {}
