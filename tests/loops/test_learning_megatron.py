"""The learning proof of test_learning.py with the Megatron trainer (`trainer=megatron lora_mode=raw`): the default
recipe learns, so the Megatron trainer's updates reach the engine through the PEFT export.

The control of that proof is test_learning.py's run under the fault switch (rollouts kept on the initial adapter,
push verification off): it shows that this recipe's reward does not rise on its own, from the prompt order or the
engine's sampling. That control does not depend on the trainer backend (its engines never take a trained adapter,
so what the trainer computes never reaches a rollout), so it is not repeated here with Megatron: the only thing a
Megatron control run would add is 20 more steps of the same frozen rollouts."""

import time

import pytest

from tests.loops.recipe_runs import LEARNING_RUN, MARGIN, gain, run_default_recipe

MEGATRON = ("trainer=megatron", "lora_mode=raw")
RUN_TIMEOUT_S = 1500  # a Megatron step on CPU takes longer than an FSDP one: the run may take ~10 min under load

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


def test_megatron_default_recipe_learns(tmp_path):
    started = time.monotonic()
    learned = run_default_recipe(tmp_path / "adapter", *MEGATRON, LEARNING_RUN, fault=False, timeout_s=RUN_TIMEOUT_S)
    print(f"gain {gain(learned):+.3f} in {time.monotonic() - started:.0f} s")
    assert gain(learned) >= MARGIN, learned
