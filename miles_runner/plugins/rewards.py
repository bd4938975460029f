"""Rewards: ``reward(prompt, replies) -> float`` where ``replies`` are the assistant's turns in order.

Pure functions of the prompt and the transcript, so a reward can be recomputed from a saved episode.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from miles_runner.plugins.registry import Registry
from miles_runner.plugins.tasks import Prompt, first_number

RewardFn = Callable[[Prompt, list[str]], float]
REWARDS: Registry[RewardFn] = Registry("reward")


@REWARDS.register("exact_match")
def exact_match(prompt: Prompt, replies: list[str]) -> float:
    """1 when the first number of the last reply equals the label, else 0."""
    return float(bool(replies) and first_number(replies[-1]) == int(prompt.label))


@REWARDS.register("hit_within_turns")
@REWARDS.register("guess_number")
def guess_number(prompt: Prompt, replies: list[str]) -> float:
    """1 for a first-turn hit, 0.2 less per extra turn; 0 when no turn within the limit hits."""
    max_turns = int(prompt.metadata.get("max_turns", len(replies)))
    for turn, reply in enumerate(replies[:max_turns]):
        if first_number(reply) == int(prompt.label):
            return 1.0 - 0.2 * turn
    return 0.0


BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
DECIMAL = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # 1,234 and 3.5 are one number each


@REWARDS.register("math")
def math_answer(prompt: Prompt, replies: list[str]) -> float:
    """1 when the final answer equals the label: the last \\boxed{...} if any, else the last number."""
    if not replies:
        return 0.0
    text = replies[-1]
    boxed = BOXED.findall(text)
    answer = boxed[-1].strip() if boxed else (DECIMAL.findall(text) or [""])[-1]
    return float(_normalize(answer) == _normalize(prompt.label))


def _normalize(answer: str) -> str:
    return answer.replace(",", "").replace("$", "").strip().rstrip(".")
