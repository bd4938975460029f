"""The TRL side's feedback loop (bench/peers/trl_rollout.py) builds the token stream the chat template renders for
the same transcript, with the feedback masked out; its pieces need only a tokenizer (no TRL here)."""

import pytest
from transformers import AutoTokenizer

from bench.peers.trl_rollout import IM_END, Episode, play
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.plugins.tasks import TASKS


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_tiny_model("tiny-moe"))


def start(tokenizer, index: int = 0):
    task = TASKS.get("count_retry")(seed=0)
    prompt = task.prompt(index)
    text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
    return task, Episode(prompt, tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("closed", [True, False], ids=["reply-ended-its-turn", "reply-cut-at-the-token-limit"])
def test_a_wrong_reply_gets_the_feedback_turn_the_chat_template_renders(tokenizer, closed):
    task, episode = start(tokenizer)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    wrong = str(int(episode.prompt.label) % 6 + 1)
    reply = tokenizer.encode(wrong, add_special_tokens=False) + ([im_end] if closed else [])
    play(episode, reply, task, tokenizer, im_end)
    feedback = task.feedback(episode.prompt, [wrong])
    transcript = [
        *episode.prompt.messages,
        {"role": "assistant", "content": wrong},
        {"role": "user", "content": feedback},
    ]
    assert not episode.done and episode.replies == [wrong]
    assert tokenizer.decode(episode.context()) == tokenizer.apply_chat_template(
        transcript, add_generation_prompt=True, tokenize=False
    )
    assert episode.mask == [1] * len(reply) + [0] * (len(episode.completion) - len(reply))


def test_a_right_reply_ends_the_episode(tokenizer):
    task, episode = start(tokenizer, index=1)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    reply = [*tokenizer.encode(episode.prompt.label, add_special_tokens=False), im_end]
    play(episode, reply, task, tokenizer, im_end)
    assert episode.done and episode.completion == reply and episode.mask == [1] * len(reply)
