"""Tasks: deterministic prompt sources (single-turn) and environments (multi-turn), registered by name.

A task is an infinite, seeded sequence: ``task.prompt(i)`` depends only on (task name, seed, i), so a data
cursor (an int) is all a run has to checkpoint to resume exactly (``PromptStream``). A multi-turn task
also answers each assistant reply with ``feedback``; ``None`` ends the episode.

Shipped tasks are small enough for the tiny CPU model (answers are short integers, scored by the
``exact_match`` reward):
- ``arith``: "What is a plus b?" with single-digit operands;
- ``reverse``: reverse a 2-3 digit number;
- ``count``: how many words a short list has;
- ``count_retry``: ``count`` with a second try after "Wrong." (multi-turn, as learnable as count);
- ``jsonl``: prompts and labels from a JSONL file (``rollout.data``), for real data sets;
- ``guess_number``: multi-turn game: find a hidden number in 1..high (high in 2..9, stated in the prompt)
  within ``max_turns`` replies, told "Higher." or "Lower." after each wrong guess.
"""

from __future__ import annotations

import json
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from miles_runner.plugins.registry import Registry

Message = dict[str, str]
NUMBER = re.compile(r"-?\d+")


def first_number(text: str) -> int | None:
    """The first integer written in ``text`` (how every shipped task reads an answer)."""
    match = NUMBER.search(text)
    return int(match.group()) if match else None


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the task's sequence (the data cursor value that produced it)
    messages: list[Message]
    label: str  # the verifiable answer
    metadata: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    name: ClassVar[str]
    max_turns: ClassVar[int] = 1
    answer_range: ClassVar[tuple[int, int]]  # the well-formed answers a random policy picks from

    needs_data: ClassVar[bool] = False  # prompts come from rollout.data (a file), not from the seed alone

    def __init__(self, seed: int = 0, data: str = "") -> None:
        self.seed = seed
        self.data = data

    def prompt(self, index: int) -> Prompt:
        # A string seed is hashed deterministically (sha512), unlike hash() of a tuple.
        return self.make(index, random.Random(f"{self.name}:{self.seed}:{index}"))

    @abstractmethod
    def make(self, index: int, rng: random.Random) -> Prompt: ...

    def feedback(self, prompt: Prompt, replies: list[str]) -> str | None:
        """The environment's answer to the latest reply, or ``None`` when the episode is over."""
        return None

    def random_reply(self, prompt: Prompt, rng: random.Random) -> str:
        """A well-formed but uninformed answer (the format pre-training's policy, see rollout.pretrain)."""
        return str(rng.randint(*self.answer_range))

    def rows(self) -> list[dict[str, Any]]:
        """The records of the data file that a task which `needs_data` makes its prompts from."""
        raise NotImplementedError(f"task {self.name} reads no data file")


TASKS: Registry[type[Task]] = Registry("task")


def _user(text: str) -> list[Message]:
    return [{"role": "user", "content": text}]


@TASKS.register("arith")
class ArithTask(Task):
    name = "arith"
    answer_range = (0, 18)

    def make(self, index: int, rng: random.Random) -> Prompt:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return Prompt(index, _user(f"What is {a} plus {b}? Reply with a single number."), str(a + b))


@TASKS.register("reverse")
class ReverseTask(Task):
    name = "reverse"

    def random_reply(self, prompt: Prompt, rng: random.Random) -> str:
        return "".join(rng.sample(prompt.label, len(prompt.label)))

    def make(self, index: int, rng: random.Random) -> Prompt:
        digits = "".join(rng.choice("123456789") for _ in range(rng.randint(2, 3)))
        return Prompt(index, _user(f"Reverse the digits of {digits}. Reply with a single number."), digits[::-1])


@TASKS.register("count")
class CountTask(Task):
    name = "count"
    answer_range = (1, 6)
    WORDS = ("cat", "dog", "sun", "sky", "one", "yes", "no", "blue")

    def make(self, index: int, rng: random.Random) -> Prompt:
        words = [rng.choice(self.WORDS) for _ in range(rng.randint(1, 6))]
        return Prompt(index, _user(f"How many words: {' '.join(words)}? Reply with a single number."), str(len(words)))


@TASKS.register("count_retry")
class CountRetryTask(CountTask):
    """``count`` as a two-turn game: a wrong first answer is told so, and the agent answers again. The skill
    is the same as count's (which LoRA GRPO learns on CPU), the transcript is multi-turn."""

    name = "count_retry"
    max_turns = 2

    def make(self, index: int, rng: random.Random) -> Prompt:
        prompt = super().make(index, rng)
        return Prompt(prompt.index, prompt.messages, prompt.label, {"max_turns": self.max_turns})

    def feedback(self, prompt: Prompt, replies: list[str]) -> str | None:
        if first_number(replies[-1]) == int(prompt.label) or len(replies) >= self.max_turns:
            return None
        return "Wrong. Reply with a single number."


@TASKS.register("guess_number")
class GuessNumberTask(Task):
    """Find a secret in 1..high (``high`` varies per prompt) in ``max_turns`` replies, told higher or lower.

    The range is part of the prompt, so reading it (guessing inside it) and then following the feedback
    are both rewarded: a policy that guesses uniformly in ``answer_range`` is well below the ceiling.
    """

    name = "guess_number"
    max_turns = 3
    answer_range = (1, 9)

    def make(self, index: int, rng: random.Random) -> Prompt:
        high = rng.randint(2, self.answer_range[1])
        secret = rng.randint(1, high)
        text = f"Guess the number between 1 and {high}. Reply with a single number."
        return Prompt(index, _user(text), str(secret), {"max_turns": self.max_turns, "high": high})

    def feedback(self, prompt: Prompt, replies: list[str]) -> str | None:
        guess = first_number(replies[-1])
        if guess == int(prompt.label) or len(replies) >= self.max_turns:
            return None
        if guess is None:
            return "Reply with a single number."
        return "Higher." if guess < int(prompt.label) else "Lower."


@TASKS.register("jsonl")
class JsonlTask(Task):
    """Prompts from a JSONL file (rollout.data): one object a line, ``{"prompt": str or [messages], "label":
    str, "metadata": {...}}``; prompt ``i`` is line ``i`` modulo the line count, so the cursor still resumes."""

    name = "jsonl"
    needs_data = True
    answer_range = (0, 9)

    def __init__(self, seed: int = 0, data: str = "") -> None:
        super().__init__(seed, data)
        self._rows: list[dict[str, Any]] | None = None

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is None:
            self._rows = read_jsonl_prompts(self.data)
        return self._rows

    def make(self, index: int, rng: random.Random) -> Prompt:
        row = self.rows()[index % len(self.rows())]
        prompt = row["prompt"]
        messages = _user(prompt) if isinstance(prompt, str) else list(prompt)
        return Prompt(index, messages, str(row["label"]), dict(row.get("metadata") or {}))


def read_jsonl_prompts(path: str) -> list[dict[str, Any]]:
    if not path or not Path(path).is_file():
        raise ValueError(f"task jsonl needs rollout.data to name a JSONL file of prompts; {path!r} is not a file")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    bad = [i for i, row in enumerate(rows) if not isinstance(row, dict) or "prompt" not in row or "label" not in row]
    if not rows or bad:
        raise ValueError(f"{path}: every line needs 'prompt' and 'label' (bad lines: {bad[:5]}, {len(rows)} lines)")
    return rows


def toy_task_names() -> list[str]:
    """The tasks that need no data file (format pre-training plays these)."""
    return [name for name in TASKS.names() if not TASKS.get(name).needs_data]


class PromptStream:
    """Prompts in order from a data cursor; ``state_dict`` is what a checkpoint stores to resume exactly."""

    def __init__(self, task: Task, cursor: int = 0) -> None:
        self.task = task
        self.cursor = cursor

    def next_batch(self, n: int) -> list[Prompt]:
        prompts = [self.task.prompt(self.cursor + i) for i in range(n)]
        self.cursor += n
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "seed": self.task.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.task.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from the task's {self.task.seed}")
        self.cursor = int(state["cursor"])
