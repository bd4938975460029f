"""The agentic row on TRL: the feedback loop (a wrong answer gets the task's feedback as a user turn and another
try) as a GRPOTrainer ``rollout_func`` (experimental in TRL 1.16), run by the peers venv.

TRL's own multi-turn support is tool calling (``tools`` / ``environment_factory``): the model must emit tool calls
the chat template parses, and the reply comes back as a tool message. The project's multi-turn tasks answer as
the user does ("Wrong. Reply with a single number."), so the loop is written here, on TRL's own generation
(``_generate_single_turn``: HF ``generate`` on the peft model, with the trainer's sampling settings). The sample
is one token stream, prompt | reply 1 | feedback | reply 2, as miles' session server records it; ``env_mask``
keeps the feedback tokens out of the loss, and the rewards get every reply (``replies``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from miles_runner.plugins.tasks import Message, Prompt, Task

IM_END = "<|im_end|>"


def prompt_key(messages: list[Message]) -> str:
    return json.dumps(messages, sort_keys=True)


@dataclass
class Episode:
    prompt: Prompt
    prompt_ids: list[int]
    completion: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: the environment's
    replies: list[str] = field(default_factory=list)
    done: bool = False

    def context(self) -> list[int]:
        return self.prompt_ids + self.completion

    def add(self, ids: list[int], model: bool) -> None:
        self.completion += ids
        self.mask += [int(model)] * len(ids)


def feedback_ids(tokenizer, feedback: str, reply_closed: bool) -> list[int]:
    """The tokens between a reply and the next: the end of the turn (when the reply did not end it), the user's
    feedback turn and the next assistant header, as the chat template renders them."""
    turn = tokenizer.apply_chat_template(
        [{"role": "user", "content": feedback}], add_generation_prompt=True, tokenize=False
    )
    text = ("" if reply_closed else IM_END) + "\n" + turn
    return tokenizer.encode(text, add_special_tokens=False)


def feedback_rollout(task: Task, prompts: list[Prompt], max_turns: int):
    """A rollout_func playing `task` for up to `max_turns` replies; `prompts` are the dataset's (TRL passes the
    messages only: the task prompt, with its label, is found by them)."""
    by_messages = {prompt_key(p.messages): p for p in prompts}

    def rollout(messages: list[list[Message]], trainer) -> dict:
        tokenizer = trainer.processing_class
        im_end = tokenizer.convert_tokens_to_ids(IM_END)
        prompt_ids, _, _ = trainer._tokenize_prompts(messages)
        episodes = [Episode(by_messages[prompt_key(m)], list(ids)) for m, ids in zip(messages, prompt_ids, strict=True)]
        for _ in range(max_turns):
            live = [e for e in episodes if not e.done]
            if not live:
                break
            replies, _ = trainer._generate_single_turn([e.context() for e in live], None, {}, trainer.num_generations)
            for episode, reply in zip(live, replies, strict=True):
                play(episode, list(reply), task, tokenizer, im_end)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": [e.completion for e in episodes],
            "logprobs": None,
            "env_mask": [e.mask for e in episodes],
            "replies": [e.replies for e in episodes],
        }

    return rollout


def play(episode: Episode, reply: list[int], task: Task, tokenizer, im_end: int) -> None:
    """Take the model's reply; the episode ends, or gets the task's feedback for the next turn."""
    episode.add(reply, model=True)
    episode.replies.append(tokenizer.decode(reply, skip_special_tokens=True))
    feedback = task.feedback(episode.prompt, episode.replies)
    if feedback is None:
        episode.done = True
    else:
        episode.add(feedback_ids(tokenizer, feedback, bool(reply) and reply[-1] == im_end), model=False)
