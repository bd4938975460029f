"""BridgeTrainer (trainer=megatron lora_mode=bridge) on one process: MegatronTrainer's loop around Bridge's model
and LoRA. A step trains the adapter; the saved folder is a PEFT adapter that the FSDP trainer (HF + peft) loads
with the same log-probs, with and without the adapter (Bridge's save_hf_adapter writes it: adapter_state and
adapter_config are its content); with routing replay it trains on the rollout's routes, with the raw trainer's
log-probs under them; what Bridge cannot do is refused by name; a checkpoint resumes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ..test_trainer import samples, settings_from


def bridge_trainer(model_path: str, settings, qkv_format: str = "thd"):
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.megatron.bridge import BridgeTrainer

    return BridgeTrainer(model_path, settings, parallel.Layout(), qkv_format=qkv_format)


@pytest.mark.parametrize("qkv_format", ["thd", "bshd"])
def test_a_step_trains_and_the_saved_adapter_gives_the_fsdp_trainer_the_same_log_probs(
    tiny_moe_path, tmp_path, qkv_format
):
    from safetensors.torch import load_file

    from miles_runner.trainer.fsdp import FSDPTrainer

    ours = bridge_trainer(tiny_moe_path, settings_from(), qkv_format)
    before = ours.adapter_state()
    metrics = ours.train(samples())
    after = ours.adapter_state()
    assert metrics["grad_norm"] > 0 and ours.step == 1
    assert max(float((after[name] - before[name]).abs().max()) for name in after) > 1e-3
    folder = ours.save_adapter(tmp_path / "adapter")
    assert json.loads((folder / "adapter_config.json").read_text()) == ours.adapter_config()
    written = load_file(folder / "adapter_model.safetensors")
    assert sorted(written) == sorted(after) and all(torch.equal(written[k], after[k]) for k in after)
    fsdp = FSDPTrainer(tiny_moe_path, settings_from(folder))
    for adapter in (True, False):
        for a, b in zip(
            ours.compute_log_probs(samples(), adapter=adapter),
            fsdp.compute_log_probs(samples(), adapter=adapter),
            strict=True,
        ):
            assert a == pytest.approx(b, abs=1e-5)
    assert ours.compute_log_probs(samples()) != ours.compute_log_probs(samples(), adapter=False)


def routed_samples(layout) -> list:
    """samples() with random rollout routes (distinct experts per token and layer) for every token but the last."""
    generator = torch.Generator().manual_seed(2)
    out = []
    for sample in samples():
        scores = torch.rand(len(sample.tokens) - 1, layout.num_layers, layout.num_experts, generator=generator)
        routes = scores.argsort(dim=-1)[..., : layout.top_k].to(torch.int32).numpy()
        out.append(dataclasses.replace(sample, rollout_routed_experts=routes))
    return out


def test_a_step_with_routing_replay_trains_on_the_rollouts_routes(tiny_moe_path):
    # With B zero the log-probs are the base model's: under replay, the raw trainer's under the same routes.
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.megatron.trainer import MegatronTrainer

    replaying = bridge_trainer(tiny_moe_path, settings_from(routing_replay=True))
    batch = routed_samples(replaying.routing)
    replayed = replaying.compute_log_probs(batch)
    own = bridge_trainer(tiny_moe_path, settings_from()).compute_log_probs(batch)
    raw = MegatronTrainer(tiny_moe_path, settings_from(routing_replay=True), parallel.Layout())
    for ours, theirs, unreplayed in zip(replayed, raw.compute_log_probs(batch), own, strict=True):
        assert ours == pytest.approx(theirs, abs=1e-5)
        assert ours != pytest.approx(unreplayed, abs=1e-3)
    before = replaying.adapter_state()
    metrics, raw_metrics = replaying.train(batch), raw.train(batch)
    assert 0.0 < metrics["routing_replay_diff_frac"] <= 1.0
    assert metrics["routing_replay_diff_frac"] == pytest.approx(raw_metrics["routing_replay_diff_frac"])
    assert metrics["grad_norm"] > 0
    after = replaying.adapter_state()
    assert max(float((after[name] - before[name]).abs().max()) for name in after) > 1e-3
    with pytest.raises(ValueError, match="rollout_routed_experts"):
        replaying.train(samples())  # replay on, and the samples carry no routes


def test_what_bridge_cannot_do_is_refused(tiny_moe_path, tmp_path):
    with pytest.raises(ValueError, match="cannot start from a PEFT adapter"):
        bridge_trainer(tiny_moe_path, settings_from(tmp_path))


def test_a_checkpoint_resumes_with_no_lost_or_repeated_step(tiny_moe_path):
    # Each rank's own LoRA shards and optimizer state come back (no PEFT import needed).
    from miles_runner.config.schema import OptimizerConfig

    settings = settings_from(optimizer=OptimizerConfig(name="adam", lr=0.01))
    straight = bridge_trainer(tiny_moe_path, settings)
    straight.train(samples())
    checkpoint = straight.state_dict()
    straight.train(samples((0.0, 1.0, 0.0, 0.5)))
    resumed = bridge_trainer(tiny_moe_path, settings)
    resumed.load_state_dict(checkpoint)
    resumed.train(samples((0.0, 1.0, 0.0, 0.5)))
    assert resumed.step == straight.step == 2
    for name, tensor in straight.adapter_state().items():
        assert torch.equal(resumed.adapter_state()[name], tensor), name
