"""Format pre-training of the tiny base model: teach it the shape of an answer, not the answer.

A tiny random model (even at init scale 0.1) spreads its first reply token almost uniformly over the whole
vocabulary, so a verifiable reward is ~never earned and GRPO has nothing to reinforce. This step plays
every registered task with a *random but well-formed* policy (``Task.random_reply``: a number in the
task's answer range, with the environment's real feedback on multi-turn tasks) and fits the base model,
all weights, on the assistant turns. The result answers every prompt with a plausible number at about
chance accuracy; reward then comes only from choosing the right number, which is what the LoRA learns.

A transcript is written in the chat format of the model's tokenizer, as the rollouts will see it: ChatML for tiny-moe
and tiny-dense; GLM-4.7's for tiny-glm5, token for token as the session server's TITO family glm47 assembles a
multi-turn episode (session/tito.py), each reply closing the thinking its generation prompt opened and ending with the
token that opens the next message.

Deterministic from ``seed``. ``ensure_format_pretrained`` caches the result next to the plain tiny model
(``<cache>/tiny-moe-seed0-format``); ``ensure_tiny_model`` can equally call ``pretrain_format(folder)``
after building the weights (it rewrites ``model.safetensors`` in place).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles_runner.models.tiny_model import BUILDER_VERSION, builder_version, ensure_tiny_model, save_portable
from miles_runner.plugins.tasks import TASKS, Message, Task, toy_task_names

ASSISTANT_HEADER = "<|im_start|>assistant\n"
GLM_ASSISTANT = "<|assistant|>"  # a tokenizer with it speaks GLM-4.7's chat format
MARKER = "format_pretrain.json"
# Bump when the pre-training recipe changes, so cached folders are rebuilt.
PRETRAIN_VERSION = 1
DEFAULT_STEPS = 150


def random_transcript(task: Task, index: int, rng: random.Random) -> list[Message]:
    """One episode of ``task``'s prompt ``index`` played by the random well-formed policy."""
    prompt = task.prompt(index)
    messages, replies = list(prompt.messages), []
    for _ in range(task.max_turns):
        replies.append(task.random_reply(prompt, rng))
        messages.append({"role": "assistant", "content": replies[-1]})
        feedback = task.feedback(prompt, replies)
        if feedback is None:
            break
        messages.append({"role": "user", "content": feedback})
    return messages


def transcript_tokens(tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """Token ids of the transcript and a mask that is 1 on what the model writes: the replies and their end tokens."""
    if GLM_ASSISTANT in tokenizer.get_vocab():
        return glm47_transcript_tokens(tokenizer, messages)
    header = tokenizer.encode(ASSISTANT_HEADER, add_special_tokens=False)
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        text = f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
        tokens = tokenizer.encode(text, add_special_tokens=False)
        ids += tokens
        if message["role"] == "assistant":
            # The reply and its <|im_end|> are trained; the header and the trailing newline are context.
            mask += [0] * len(header) + [1] * (len(tokens) - len(header) - 1) + [0]
        else:
            mask += [0] * len(tokens)
    return ids, mask


def glm47_transcript_tokens(tokenizer, messages: Sequence[Message]) -> tuple[list[int], list[int]]:
    """The episode as the session server's ids for it: the first prompt rendered by the chat template, then each reply
    as the model writes it after ``<|assistant|><think>`` (``</think>``, the answer, and the token that opens the next
    message, which ends its turn), then the next messages as glm47's merge appends them."""
    from miles_runner.session.tito import Glm47Tito

    tito = Glm47Tito(tokenizer)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = tito.first_turn_ids(list(messages[:first]), None, {})
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
        later = next((j for j in range(i + 1, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        appended = list(messages[i + 1 : later])
        stop = "<|observation|>" if appended and appended[0]["role"] == "tool" else "<|user|>"
        reply = tito.encode(f"</think>{messages[i]['content']}{stop}")
        ids, mask = ids + reply, mask + [1] * len(reply)
        if appended:
            # glm47 drops the stop token and opens the next message with that same token, so the ids only grow.
            merged = tito.merge_tokens(list(messages[: i + 1]), ids, appended, None, {})
            if merged[: len(ids)] != ids:
                raise ValueError(f"the glm47 merge rewrote a stored turn of {messages[: i + 1]}")
            ids, mask = merged, mask + [0] * (len(merged) - len(ids))
        i = later
    return ids, mask


def _batch(tokenizer, tasks: list[Task], rng: random.Random, size: int, offset: int):
    rows = []
    for i in range(size):
        task = tasks[(offset + i) % len(tasks)]
        rows.append(transcript_tokens(tokenizer, random_transcript(task, offset + i, rng)))
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for r, (row_ids, row_mask) in enumerate(rows):
        ids[r, : len(row_ids)] = torch.tensor(row_ids)
        keep = torch.tensor(row_mask, dtype=torch.bool)
        labels[r, : len(row_ids)] = torch.where(keep, torch.tensor(row_ids), torch.tensor(-100))
    return ids, (ids != tokenizer.pad_token_id).long(), labels


def pretrain_format(
    model_dir: str | Path,
    task_names: Sequence[str] | None = None,
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> list[float]:
    """Fit the model in ``model_dir`` (in place) on random well-formed episodes; return the loss curve."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tasks = [TASKS.get(name)(seed) for name in (task_names or toy_task_names())]
    rng = random.Random(f"pretrain:{seed}")
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        ids, attention, labels = _batch(tokenizer, tasks, rng, batch_size, step * batch_size)
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    save_portable(model, folder)
    return losses


def ensure_format_pretrained(name: str = "tiny-moe", seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """The tiny model after format pre-training on every registered task, cached and built atomically."""
    base = ensure_tiny_model(name, cache_dir, seed)
    target = base.parent / f"{base.name}-format"
    recipe = format_recipe(name, seed)
    if _is_built(target, recipe):
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=base.parent))
    try:
        shutil.copytree(base, staging, dirs_exist_ok=True)
        pretrain_format(staging, seed=seed)
        (staging / MARKER).write_text(json.dumps(recipe, indent=2) + "\n")
        if not _is_built(target, recipe):  # a stale recipe's folder; never remove a good one in use
            shutil.rmtree(target, ignore_errors=True)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not _is_built(target, recipe):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def format_recipe(name: str, seed: int) -> dict[str, Any]:
    """What a pre-trained folder records (format_pretrain.json): a folder recording another recipe is rebuilt."""
    recipe: dict[str, Any] = {
        "version": PRETRAIN_VERSION,
        "seed": seed,
        "steps": DEFAULT_STEPS,
        "tasks": toy_task_names(),
    }
    if builder_version(name) != BUILDER_VERSION:
        # A base model with a version of its own: a rebuilt base makes its pre-trained folder stale too. Recorded only
        # there, so that the folders pre-trained before the models had versions of their own stay valid.
        recipe["base_version"] = builder_version(name)
    return recipe


def _is_built(folder: Path, recipe: dict) -> bool:
    marker = folder / MARKER
    return marker.is_file() and json.loads(marker.read_text()) == recipe
