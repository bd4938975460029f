"""Trainer settings for the tiny model: a small attention LoRA and GRPO groups of two."""

from __future__ import annotations

from dataclasses import replace

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.trainer.policy_trainer import TrainerSettings

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def make_settings(**overrides) -> TrainerSettings:
    adapter = AdapterSpec("miles_lora", "miles_lora", 4, 8.0, 0.0, ATTENTION, "arith", "exact_match", 0.01, 2, 2)
    settings = TrainerSettings(
        adapter, AlgorithmConfig(), OptimizerConfig(), group_size=2, global_batch_size=0, micro_batch_size=4, seed=0
    )
    return replace(settings, **overrides)
