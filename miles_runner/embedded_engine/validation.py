"""Admission checks of a generation request: SGLang's sampling checks, and this engine's size limits.

Everything here runs before a request reaches the scheduler, so a bad value is a 400 for that request alone and
never a failure inside a batched step (which would fail the requests running beside it). The sampling checks and
messages are SGLang's (``SamplingParams.verify``/``normalize``, ``TokenizerManager._validate_token_ids_logprob``),
plus a vocabulary check on ``stop_token_ids`` (SGLang builds a vocabulary-sized mask from them).

The size limits are the embedded engine's own (``--max-n``, ``--max-batch-size``; SGLang has no such flags): one
request asking for 20,000 samples held the engine for seconds and tens of megabytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from miles_runner.config.schema import EngineConfig
from miles_runner.core.sglang_protocol import GREEDY_TEMPERATURE_BELOW
from miles_runner.embedded_engine.protocol import SamplingParams

GREEDY_BELOW = GREEDY_TEMPERATURE_BELOW  # SGLang's _SAMPLING_EPS: a temperature in [0, eps) means greedy
MAX_STOP_COUNT = 32  # SGLang's limit on stop strings
DEFAULT_MAX_N = EngineConfig.max_n  # the plan's defaults (engine.max_n, engine.max_batch_size)
DEFAULT_MAX_BATCH_SIZE = EngineConfig.max_batch_size
SEED_RANGE = (-(2**63), 2**63 - 1)


def verify_sampling(p: SamplingParams, vocab_size: int) -> None:
    """SGLang's ``SamplingParams.verify`` checks and messages (NaN and infinities fail every range check)."""
    if not math.isfinite(p.temperature) or p.temperature < 0.0:
        raise ValueError(f"temperature must be a non-negative finite number, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
    if not 0.0 <= p.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise ValueError(f"top_k must be -1 (disable), or at least 1, got {p.top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}.")
    if not 0.0 < p.repetition_penalty <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {p.repetition_penalty}.")
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    if p.min_new_tokens < 0 or (p.max_new_tokens is not None and p.min_new_tokens > p.max_new_tokens):
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {p.min_new_tokens}.")
    if p.n < 1:
        raise ValueError(f"n must be at least 1, got {p.n}.")
    if p.sampling_seed is not None and not SEED_RANGE[0] <= p.sampling_seed <= SEED_RANGE[1]:
        raise ValueError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {p.sampling_seed}.")
    stops = [p.stop] if isinstance(p.stop, str) else (p.stop or [])
    if len(stops) > MAX_STOP_COUNT:
        raise ValueError(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stops)}")
    check_token_ids("stop_token_ids", p.stop_token_ids or (), vocab_size)
    if any(getattr(p, k) is not None for k in ("json_schema", "regex", "ebnf", "structural_tag")):
        raise ValueError("Constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported.")


def check_token_ids(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{field} contains out-of-vocabulary token id {token_id}; valid range is [0, {vocab_size})."
            )


@dataclass(frozen=True)
class Limits:
    """How much one request may ask for: ``n`` samples per prompt, and prompts x n outputs in all."""

    max_n: int = DEFAULT_MAX_N
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE

    def check_request(self, samples_per_prompt: list[int]) -> None:
        """Check each prompt's n, then the request's total outputs (before any of them is built)."""
        for n in samples_per_prompt:
            self.check_n(n)
        self.check_batch(sum(samples_per_prompt))

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise ValueError(
                f"n ({n}) is above this engine's limit of {self.max_n} samples per prompt (--max-n; the plan's "
                "engine.max_n); ask for fewer samples or raise the limit."
            )

    def check_batch(self, outputs: int) -> None:
        if outputs > self.max_batch_size:
            raise ValueError(
                f"the request asks for {outputs} outputs (prompts x n), above this engine's limit of "
                f"{self.max_batch_size} (--max-batch-size; the plan's engine.max_batch_size); split it into "
                "smaller requests or raise the limit."
            )
