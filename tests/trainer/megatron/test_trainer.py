"""The Megatron trainer on one process: the FSDP trainer's contract (same loss, same update from the same adapter,
same metrics, checkpoints that resume with no lost or repeated step), in both qkv formats."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from miles_runner.config.schema import OptimizerConfig
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.trainer import MegatronTrainer

from ..settings import make_settings

pytestmark = pytest.mark.integration

PROMPT = [1, 60, 61, 62, 63, 4]
RESPONSES = ([70, 71, 2], [90, 91, 2], [70, 2], [91, 92, 93, 2])
REWARDS = (1.0, 0.0, 0.5, 0.0)
# The update is the gradient (no clipping: the fused and unfused gradients have different norms), so a wrong loss
# or reduction shows.
SGD = OptimizerConfig(name="sgd", lr=0.5, clip_grad=1e9)


def samples(rewards=REWARDS) -> list[Sample]:
    return [
        Sample(PROMPT + r, len(r), [1] * len(r), [], None, SampleStatus.COMPLETED, reward=w)
        for r, w in zip(RESPONSES, rewards, strict=True)
    ]


def settings_from(start: Path | None = None, **overrides):
    settings = make_settings(**{"optimizer": SGD, **overrides})
    if start is not None:
        settings = dataclasses.replace(settings, adapter=dataclasses.replace(settings.adapter, init_path=str(start)))
    return settings


def megatron(model_path: str, settings, qkv_format: str = "thd") -> MegatronTrainer:
    return MegatronTrainer(model_path, settings, parallel.Layout(), qkv_format=qkv_format)


def fused_update(peft_after: dict, before: dict, name: str) -> torch.Tensor:
    """What one SGD step does to the shared lora_A of Megatron's fused linear_qkv: the sum of the three steps peft
    takes on q, k and v's separate copies of it (each gets its own gradient)."""
    names = [name.replace(".q_proj.", f".{p}.") for p in ("q_proj", "k_proj", "v_proj")]
    return sum(peft_after[n] for n in names) - 2 * before[name]


@pytest.mark.parametrize("qkv_format", ["thd", "bshd"])
def test_a_step_updates_the_adapter_as_the_fsdp_trainer_does(tiny_model_path, start_adapter, qkv_format):
    settings = settings_from(start_adapter)
    fsdp, ours = FSDPTrainer(tiny_model_path, settings), megatron(tiny_model_path, settings, qkv_format)
    before = ours.adapter_state()
    expected, metrics = fsdp.train(samples()), ours.train(samples())
    after, reference = ours.adapter_state(), fsdp.adapter_state()
    assert set(after) == set(reference)
    assert max(float((after[name] - before[name]).abs().max()) for name in after) > 1e-3  # the step did something
    for name, tensor in reference.items():
        if ".lora_A." in name and ".o_proj." not in name:
            q_name = name.replace(".k_proj.", ".q_proj.").replace(".v_proj.", ".q_proj.")
            tensor = fused_update(reference, before, q_name)
        assert torch.allclose(after[name], tensor, atol=1e-5), name
    assert set(metrics) == set(expected)
    for key in ("loss", "pg_clipfrac", "reward_mean", "kl"):
        if key in expected:
            assert metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def test_log_probs_match_the_fsdp_trainer_with_and_without_the_adapter(tiny_model_path, start_adapter):
    settings = settings_from(start_adapter)
    fsdp, ours = FSDPTrainer(tiny_model_path, settings), megatron(tiny_model_path, settings)
    for adapter in (True, False):
        mine = ours.compute_log_probs(samples(), adapter=adapter)
        theirs = fsdp.compute_log_probs(samples(), adapter=adapter)
        for a, b in zip(mine, theirs, strict=True):
            assert a == pytest.approx(b, abs=1e-5)
    assert ours.compute_log_probs(samples()) != ours.compute_log_probs(samples(), adapter=False)


def test_packed_and_padded_formats_give_the_same_log_probs(tiny_model_path, start_adapter):
    settings = settings_from(start_adapter)
    packed = megatron(tiny_model_path, settings, "thd").compute_log_probs(samples())
    padded = megatron(tiny_model_path, settings, "bshd").compute_log_probs(samples())
    for a, b in zip(packed, padded, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_saved_adapter_is_a_peft_folder_of_the_adapter_state(tiny_model_path, start_adapter, tmp_path):
    from safetensors.torch import load_file

    ours = megatron(tiny_model_path, settings_from(start_adapter))
    ours.train(samples())
    folder = ours.save_adapter(tmp_path / "adapter")
    saved = load_file(folder / "adapter_model.safetensors")
    state = ours.adapter_state()
    assert set(saved) == set(state) and all(torch.equal(saved[k], state[k]) for k in state)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    restarted = megatron(tiny_model_path, settings_from(folder))
    assert all(torch.equal(restarted.adapter_state()[k], state[k]) for k in state)


def test_checkpoint_resumes_with_no_lost_or_repeated_step(tiny_model_path):
    settings = settings_from(optimizer=OptimizerConfig(name="adam", lr=0.01))
    straight = megatron(tiny_model_path, settings)
    straight.train(samples())
    checkpoint = straight.state_dict()
    straight.train(samples((0.0, 1.0, 0.0, 0.5)))
    resumed = megatron(tiny_model_path, settings)
    resumed.load_state_dict(checkpoint)
    assert resumed.step == 1
    resumed.train(samples((0.0, 1.0, 0.0, 0.5)))
    assert resumed.step == straight.step == 2
    for name, tensor in straight.adapter_state().items():
        assert torch.equal(resumed.adapter_state()[name], tensor), name


def test_a_checkpoint_of_another_layout_is_refused(tiny_model_path):
    ours = megatron(tiny_model_path, settings_from())
    checkpoint = ours.state_dict()
    checkpoint["layout"] = {"tp": 2}
    with pytest.raises(ValueError, match="same TP/EP/PP"):
        ours.load_state_dict(checkpoint)


def test_equal_rewards_leave_the_adapter_unchanged(tiny_model_path, start_adapter):
    ours = megatron(tiny_model_path, settings_from(start_adapter))
    before = ours.adapter_state()
    ours.train(samples((0.5, 0.5, 0.5, 0.5)))
    assert all(torch.equal(ours.adapter_state()[k], v) for k, v in before.items())
