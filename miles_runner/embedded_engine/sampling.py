"""Choosing the next token for one request, SGLang-style.

Logprobs are those of the temperature-scaled distribution before top-k/top-p/min-p filtering (SGLang's
default; with temperature 0, i.e. greedy, the raw logits). Each request samples with its own seeded
``torch.Generator``, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """Resolved sampling parameters of one request (defaults applied, validated)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class Choice:
    token_id: int
    logprobs: torch.Tensor  # (vocab,) log-probabilities the logprob fields report


def choose_token(
    logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator, banned: frozenset[int]
) -> Choice:
    """Pick a token from ``logits`` (vocab,) under ``config``; ``banned`` ids are masked (min_new_tokens)."""
    logits = logits.float()
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if config.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        return Choice(int(torch.argmax(logits)), logprobs)
    logprobs = torch.log_softmax(logits / config.temperature, dim=-1)
    probs = _filtered_probs(logprobs.exp(), config)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return Choice(token, logprobs)


def _filtered_probs(probs: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    if config.top_k > 0:
        kth = torch.topk(probs, min(config.top_k, probs.numel())).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep = before < config.top_p * sorted_probs.sum()
        keep[0] = True  # the most likely token always stays (a tiny top_p, e.g. 5e-324, underflows to keep none)
        sorted_probs = torch.where(keep, sorted_probs, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    if config.min_p > 0.0:
        probs = torch.where(probs >= config.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()
