"""In-process GRPO: the trainer's own peft model generates, a reward scores, the trainer steps. No servers.

This is the smallest complete RL loop (rollout -> reward -> advantages -> train), used to establish that a
task/model/LoRA setup learns on CPU (bench/grpo_learning.py) and by the learning test. The fault switch
``adapter_in_rollouts=False`` rolls out with the adapter disabled (the base model), as a run whose adapter
never reaches the engine would: its reward must not improve.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.core.adapters import AdapterSpec
from miles_runner.plugins.lookup import get_reward, make_task
from miles_runner.plugins.tasks import PromptStream
from miles_runner.rollout.inprocess import SamplingSettings, generate_samples
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.policy_trainer import TrainerSettings


@dataclass(frozen=True)
class LocalRunConfig:
    model_path: str
    adapter: AdapterSpec  # task, reward, rank, alpha, targets, lr, prompts and samples per step
    sampling: SamplingSettings
    steps: int
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    micro_batch_size: int = 16
    seed: int = 0
    adapter_in_rollouts: bool = True  # fault switch for the can-fail test: False samples from the base model


@dataclass
class LocalRunResult:
    rewards: list[float]  # mean reward per step
    metrics: list[dict[str, float]]
    wall_s: float

    def window_mean(self, first: bool, width: int = 5) -> float:
        part = self.rewards[:width] if first else self.rewards[-width:]
        return sum(part) / len(part)


def run_local_grpo(
    config: LocalRunConfig,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    save_adapter_to: Path | None = None,
) -> LocalRunResult:
    from transformers import AutoTokenizer

    a = config.adapter
    settings = TrainerSettings(
        a,
        config.algorithm,
        config.optimizer,
        group_size=a.n_samples_per_prompt,
        global_batch_size=0,
        micro_batch_size=config.micro_batch_size,
        temperature=config.sampling.temperature,
        seed=config.seed,
        routing_replay=config.sampling.return_routed_experts,
    )  # R3: replay what was recorded
    trainer = FSDPTrainer(config.model_path, settings)
    tokenizer = AutoTokenizer.from_pretrained(config.model_path, padding_side="left")
    task, reward_fn = make_task(a.task, config.seed, a.data), get_reward(a.reward)
    stream = PromptStream(task)
    torch.manual_seed(config.seed)
    rewards, metrics = [], []
    started = time.perf_counter()
    for step in range(config.steps):
        samples = _rollout(trainer, tokenizer, task, stream.next_batch(a.rollout_batch_size), reward_fn, config)
        step_metrics = trainer.train(samples)
        rewards.append(step_metrics["reward_mean"])
        metrics.append(step_metrics)
        if on_step:
            on_step(step, step_metrics)
    if save_adapter_to is not None:
        trainer.save_adapter(save_adapter_to)
    return LocalRunResult(rewards, metrics, time.perf_counter() - started)


def _rollout(trainer: FSDPTrainer, tokenizer, task, prompts, reward_fn, config: LocalRunConfig):
    model, n = trainer.model, config.adapter.n_samples_per_prompt
    model.eval()
    if config.adapter_in_rollouts:
        return generate_samples(model, tokenizer, task, prompts, n, reward_fn, config.sampling)
    with model.disable_adapter():
        return generate_samples(model, tokenizer, task, prompts, n, reward_fn, config.sampling)
