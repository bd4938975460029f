"""In-process rollouts: generate episodes with a local HF/peft model, no servers.

Used by the learning benchmark and its test, and as the reference a served rollout is compared with. Token
in, token out, as a session server does it: each episode is one growing token list; generated tokens get
``loss_mask`` 1 and their sampling log-prob, environment tokens (feedback turns) get 0. A multi-turn task
is driven by ``task.feedback``; a single-turn task is the one-turn case of the same loop.

With ``return_routed_experts`` an episode also carries its MoE routing as an engine returns it (R3): each turn
forwards the whole episode so far, and its routers' choices give rows for every token but the last sampled one
(never forwarded), ``(len(ids) - 1, num_layers, top_k)``; the last turn's rows are the episode's.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from miles_runner.models.moe_routing import recording, routing_layout
from miles_runner.plugins.rewards import RewardFn
from miles_runner.plugins.tasks import Prompt, Task
from miles_runner.session.samples import Sample, SampleStatus


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_turns: int = 1
    return_routed_experts: bool = False  # R3: record each episode's MoE routing


@dataclass
class _Episode:
    prompt: Prompt
    ids: list[int]
    prompt_length: int
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    routed_experts: np.ndarray | None = None  # (len(ids) - 1, num_layers, top_k) after a turn, when recorded
    truncated: bool = False
    done: bool = False


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def _left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    return ids, mask


@torch.no_grad()
def _generate_turn(model, tokenizer, episodes: list[_Episode], settings: SamplingSettings) -> None:
    """One assistant turn for every episode given, appended in place with its log-probs."""
    ids, mask = _left_pad([e.ids for e in episodes], tokenizer.pad_token_id)
    with recording(model) if settings.return_routed_experts else nullcontext() as routers:
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_p=settings.top_p,
            top_k=0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id,
        )
    new_tokens = out.sequences[:, ids.shape[1] :]
    routing = _batch_routing(model, routers, len(episodes)) if routers is not None else None
    log_probs = (torch.stack(out.logits, dim=1).float() / settings.temperature).log_softmax(-1)
    token_log_probs = log_probs.gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
    eos = set(model.generation_config.eos_token_id or [tokenizer.eos_token_id])
    for row, episode in enumerate(episodes):
        tokens = new_tokens[row].tolist()
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
        episode.truncated = end is None
        tokens = tokens[: end or len(tokens)]
        if routing is not None:  # this row's positions: its prompt (left-padded) then its tokens but the last
            prompt_start = ids.shape[1] - len(episode.ids)
            episode.routed_experts = routing[row, prompt_start : ids.shape[1] + len(tokens) - 1]
        episode.ids += tokens
        episode.loss_mask += [1] * len(tokens)
        episode.log_probs += token_log_probs[row, : len(tokens)].tolist()
        episode.replies.append(tokenizer.decode(tokens, skip_special_tokens=True))


def _batch_routing(model, routers: dict[int, list[torch.Tensor]], batch: int) -> np.ndarray:
    """The recorded choices as ``[batch, positions, num_layers, top_k]`` int32 over every forwarded position (the
    prompt forward, then one position per decoding step); dense layers stay 0, as SGLang leaves them."""
    layout = routing_layout(model)
    per_layer = {
        layer: torch.cat([c.reshape(batch, -1, layout.top_k) for c in chosen], dim=1)
        for layer, chosen in routers.items()
    }
    positions = next(iter(per_layer.values())).shape[1]
    routing = np.zeros((batch, positions, layout.num_layers, layout.top_k), dtype=np.int32)
    for layer, choices in per_layer.items():
        routing[:, :, layer, :] = choices.numpy()
    return routing


def _append_feedback(tokenizer, episode: _Episode, feedback: str) -> None:
    close = "<|im_end|>" if episode.truncated else ""
    text = f"{close}\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
    tokens = tokenizer.encode(text, add_special_tokens=False)
    episode.ids += tokens
    episode.loss_mask += [0] * len(tokens)
    episode.log_probs += [0.0] * len(tokens)


def _to_sample(episode: _Episode, reward: float) -> Sample:
    status = SampleStatus.TRUNCATED if episode.truncated else SampleStatus.COMPLETED
    return Sample(
        tokens=episode.ids,
        response_length=len(episode.ids) - episode.prompt_length,
        loss_mask=episode.loss_mask,
        rollout_log_probs=episode.log_probs,
        rollout_routed_experts=episode.routed_experts,
        status=status,
        response="\n".join(episode.replies),
        reward=reward,
        metadata={"prompt_index": episode.prompt.index, "turns": len(episode.replies)},
    )


def generate_samples(
    model,
    tokenizer,
    task: Task,
    prompts: Sequence[Prompt],
    n_samples: int,
    reward_fn: RewardFn,
    settings: SamplingSettings,
) -> list[Sample]:
    """``n_samples`` rewarded episodes per prompt, ordered group by group (the GRPO layout)."""
    episodes = []
    for prompt in prompts:
        ids = chat_prompt_ids(tokenizer, prompt.messages)
        episodes += [_Episode(prompt, list(ids), len(ids)) for _ in range(n_samples)]
    for _ in range(settings.max_turns):
        active = [e for e in episodes if not e.done]
        if not active:
            break
        _generate_turn(model, tokenizer, active, settings)
        for episode in active:
            feedback = task.feedback(episode.prompt, episode.replies)
            if feedback is None or len(episode.replies) >= settings.max_turns:
                episode.done = True
            else:
                _append_feedback(tokenizer, episode, feedback)
    return [_to_sample(e, reward_fn(e.prompt, e.replies)) for e in episodes]
