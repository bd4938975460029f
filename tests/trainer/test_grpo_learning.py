"""The proof that LoRA GRPO learns on CPU, and that the proof can fail: in-process rollouts from the
format-pretrained tiny model on the `count` task, with the adapter applied to rollouts, and with it off."""

from __future__ import annotations

import pytest

from miles_runner.core.adapters import AdapterSpec
from miles_runner.loops.inprocess import LocalRunConfig, LocalRunResult, run_local_grpo
from miles_runner.rollout.inprocess import SamplingSettings

# The reward has levelled off by step 30 (bench/REPORT.md, case count: 0.186 -> 0.487 over 80 steps). Measured gains
# over 50 steps, seeds 0/1/2: 0.30, 0.31, 0.35.
STEPS = 50
MARGIN = 0.15  # last-5 over first-5 mean reward
NOISE = 0.08  # rollouts from the base model: the same windows must stay within this
# The control samples from the base model at every step, so its reward is one distribution throughout: its windows
# differ by the same noise over 20 steps as over 80, and 20 cost a quarter of the time.
CONTROL_STEPS = 20


@pytest.fixture(scope="module")
def pretrained_model_path() -> str:
    from miles_runner.models.format_pretrain import ensure_format_pretrained

    return str(ensure_format_pretrained("tiny-moe"))


def run(model_path: str, *, adapter_in_rollouts: bool, steps: int) -> LocalRunResult:
    adapter = AdapterSpec(
        "miles_lora",
        "miles_lora",
        8,
        16.0,
        0.0,
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        "count",
        "exact_match",
        0.005,
        16,
        8,
    )
    config = LocalRunConfig(
        model_path, adapter, SamplingSettings(max_new_tokens=4), steps, seed=0, adapter_in_rollouts=adapter_in_rollouts
    )
    return run_local_grpo(config)


@pytest.mark.slow
def test_grpo_raises_the_reward_when_rollouts_use_the_adapter(pretrained_model_path):
    result = run(pretrained_model_path, adapter_in_rollouts=True, steps=STEPS)
    assert result.window_mean(first=False) - result.window_mean(first=True) >= MARGIN, result.rewards


@pytest.mark.slow
def test_reward_stays_flat_when_rollouts_ignore_the_adapter(pretrained_model_path):
    result = run(pretrained_model_path, adapter_in_rollouts=False, steps=CONTROL_STEPS)
    assert abs(result.window_mean(first=False) - result.window_mean(first=True)) < NOISE, result.rewards
