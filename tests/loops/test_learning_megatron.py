"""The learning proof of test_learning.py with the Megatron trainer (`trainer=megatron lora_mode=raw`): the default
recipe learns, and does not when the rollouts never get the trained adapter (the fault switch, push verification
off), so the gain comes from the Megatron trainer's updates reaching the engine through the PEFT export."""

import time

import pytest

from tests.loops.recipe_runs import MARGIN, gain, run_default_recipe

MEGATRON = ("trainer=megatron", "lora_mode=raw")
RUN_TIMEOUT_S = 1500  # a Megatron step on CPU takes longer than an FSDP one: each run may take ~10 min

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)]


def timed_rewards(root, *, fault: bool) -> list[float]:
    started = time.monotonic()
    rewards = run_default_recipe(root, *MEGATRON, fault=fault, timeout_s=RUN_TIMEOUT_S)
    print(f"{'frozen' if fault else 'adapter'} run: gain {gain(rewards):+.3f} in {time.monotonic() - started:.0f} s")
    return rewards


def test_megatron_default_recipe_learns_only_when_rollouts_use_the_trained_adapter(tmp_path):
    learned = timed_rewards(tmp_path / "adapter", fault=False)
    frozen = timed_rewards(tmp_path / "frozen", fault=True)
    assert gain(learned) >= MARGIN, learned
    assert gain(frozen) < MARGIN, frozen
    assert gain(learned) - gain(frozen) >= MARGIN
