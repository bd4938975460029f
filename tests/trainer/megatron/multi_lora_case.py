"""The Megatron multi-LoRA computation the tests compare: two slots with their own rank, alpha, targets and learning
rate, each started from a non-zero adapter, trained over two `train` calls (gradients kept across them) and
stepped on the second, with the rollout's expert routes replayed (R3). The one-process test, the two-rank worker
and the single-adapter reference all run it.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.megatron import lora_export, parallel, raw_lora
from miles_runner.trainer.megatron.multi_lora import MegatronMultiLoRATrainer
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.multi_lora import MultiLoRASettings
from miles_runner.trainer.policy_trainer import TrainerSettings

# The update is the gradient (no clipping), so a wrong loss or reduction shows.
SGD = OptimizerConfig(name="sgd", lr=0.5, clip_grad=1e9)
ADAPTERS = {
    0: AdapterSpec(
        "attn", "__miles_slot_0", 4, 8.0, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"], "t", "r", 0.5, 2, 2
    ),
    1: AdapterSpec(
        "mlp", "__miles_slot_1", 8, 8.0, 0.0, ["o_proj", "gate_proj", "up_proj", "down_proj"], "t", "r", 0.3, 2, 2
    ),
}
PROMPT = [1, 60, 61, 62, 63, 4]
RESPONSES = {
    0: ([70, 71, 2], [90, 91, 2], [70, 2], [91, 92, 93, 2]),
    1: ([80, 2], [81, 82, 83, 2], [84, 2], [85, 86, 2]),
}
REWARDS = {0: (1.0, 0.0, 0.5, 0.0), 1: (0.0, 1.0, 1.0, 0.0)}


def routes(tokens: int, config: dict, seed: int) -> np.ndarray:
    """Random top-k expert choices for each token but the last, per layer: what an engine's router returned."""
    rng = np.random.default_rng(seed)
    layers, top_k = config["num_hidden_layers"], config["num_experts_per_tok"]
    experts = config.get("num_experts") or config["num_local_experts"]
    picks = [rng.permutation(experts)[:top_k] for _ in range((tokens - 1) * layers)]
    return np.array(picks, dtype=np.int32).reshape(tokens - 1, layers, top_k)


def samples(slot: int, config: dict) -> list[Sample]:
    """The slot's 4 samples (two GRPO groups of 2), with routes."""
    return [
        Sample(
            PROMPT + r,
            len(r),
            [1] * len(r),
            [],
            routes(len(PROMPT + r), config, 100 * slot + i),
            SampleStatus.COMPLETED,
            reward=w,
            metadata={"slot": slot},
        )
        for i, (r, w) in enumerate(zip(RESPONSES[slot], REWARDS[slot], strict=True))
    ]


def start_state(model_path: str, slot: int) -> dict[str, torch.Tensor]:
    """The slot's starting adapter: the slot seed's A and a seeded non-zero B (so A's gradient is not zero)."""
    trainer = single_trainer(model_path, slot, parallel.Layout())
    generator = torch.Generator().manual_seed(7 + slot)
    state = trainer.adapter_state()
    return {k: torch.randn(v.shape, generator=generator) * 0.1 if ".lora_B." in k else v for k, v in state.items()}


def single_trainer(model_path: str, slot: int, layout: parallel.Layout) -> MegatronTrainer:
    adapter = ADAPTERS[slot]
    settings = TrainerSettings(
        adapter,
        AlgorithmConfig(),
        SGD,
        group_size=adapter.n_samples_per_prompt,
        global_batch_size=adapter.rollout_batch_size * adapter.n_samples_per_prompt,
        micro_batch_size=4,
        routing_replay=True,
        seed=slot,  # the seed the multi-LoRA trainer gives the slot
    )
    return MegatronTrainer(model_path, settings, layout)


def single_reference(model_path: str, slot: int, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slot's adapter trained alone by the one-adapter Megatron trainer, from the same start."""
    trainer = single_trainer(model_path, slot, parallel.Layout())
    lora_export.load_peft_state(trainer.model, start)
    trainer.train(samples(slot, trainer.model.hf_config))
    return trainer.adapter_state()


def multi_case(
    model_path: str,
    layout: parallel.Layout,
    starts: dict[int, dict[str, torch.Tensor]],
    *,
    odd_batch: bool = False,
    trainer_class: type[MegatronMultiLoRATrainer] = MegatronMultiLoRATrainer,
) -> dict:
    """Both slots trained together; their exports after, the metrics, slot 0's checkpoint, slot 1 after slot 0
    alone stepped, and (`odd_batch`) the error one sample of a slot raises."""
    settings = MultiLoRASettings(AlgorithmConfig(), SGD, micro_batch_size=4, routing_replay=True)
    trainer = trainer_class(model_path, settings, layout)
    config = trainer.model.hf_config
    for slot, adapter in ADAPTERS.items():
        trainer.load_adapter(slot, adapter)
        with raw_lora.slot_active(trainer.model, slot):
            lora_export.load_peft_state(trainer.model, starts[slot])
    both = {slot: samples(slot, config) for slot in ADAPTERS}
    first = trainer.train(both[0][:2] + both[1][:2], step_slots=[])
    second = trainer.train(both[0][2:] + both[1][2:], step_slots=[0, 1])
    out = {"after": {slot: trainer.adapter_state(slot) for slot in ADAPTERS}, "metrics": [first, second]}
    out["configs"] = {slot: trainer.adapter_config(slot) for slot in ADAPTERS}
    out["state"] = trainer.state_dict(0)
    trainer.train(both[0][:2], step_slots=[0])  # slot 0 alone: slot 1 must not move
    out["slot1_untouched"] = trainer.adapter_state(1)
    if odd_batch:
        try:
            trainer.train(both[0][:1], step_slots=[])
        except ValueError as error:
            out["odd_batch_error"] = str(error)
    return out


def load_json_layout(text: str) -> parallel.Layout:
    return parallel.Layout(**json.loads(text))
