"""Format pre-training: random well-formed episodes, trained only on the assistant's replies."""

import random

import pytest

from miles_runner.models.format_pretrain import pretrain_format, random_transcript, transcript_tokens
from miles_runner.plugins.lookup import make_task

pytestmark = pytest.mark.integration


def test_random_transcript_plays_the_environment_until_it_ends():
    task = make_task("guess_number", seed=0)
    messages = random_transcript(task, 0, random.Random(0))
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert 1 <= len(replies) <= task.max_turns
    assert all(m["content"] in ("Higher.", "Lower.") for m in messages[2::2])


def test_only_assistant_replies_and_their_end_token_are_trained(tokenizer):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Lower."},
        {"role": "assistant", "content": "7"},
    ]
    ids, mask = transcript_tokens(tokenizer, messages)
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == "42<|im_end|>7<|im_end|>"
    assert tokenizer.decode(ids) == "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def test_pretraining_lowers_the_loss_and_rewrites_the_weights(tmp_path):
    from miles_runner.models.tiny_model import build_tiny_model

    folder = build_tiny_model(tmp_path / "m", seed=0)
    before = (folder / "model.safetensors").read_bytes()
    losses = pretrain_format(folder, ["arith"], steps=8, batch_size=8, lr=3e-3)
    assert losses[-1] < losses[0]
    assert (folder / "model.safetensors").read_bytes() != before
