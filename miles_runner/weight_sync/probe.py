"""The push probe: right after each verified push, while the trainer still holds exactly the adapter it pushed,
every engine scores one fixed token sequence under that adapter and must match the trainer's logprobs.

It checks the push itself, not a batch: every driver trains its batches past the weights that generated them
somewhere (the async schedule one version stale, multi-LoRA requests paused across a push), but the probe always
compares the same weights on both sides. The engine's input logprobs are the raw model's (SGLang 0.5.23 computes
`input_token_logprobs` by a log_softmax of the unscaled logits, logprob_processor.py), so the trainer scores the
probe at temperature 1.0 whatever the rollout temperature.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from miles_runner.sglang_client.client import EngineClient
from miles_runner.weight_sync.verify import SyncVerificationError

# Real text, the same for every push and every run: a few dozen tokens with any tokenizer.
PROBE_TEXT = (
    "User: What is 17 plus 25? Think step by step, then give the answer.\n"
    "Assistant: 17 plus 25 is 42, because 17 + 20 = 37 and 37 + 5 = 42. The answer is 42."
)


def probe_token_ids(model_path: str | Path) -> list[int]:
    """PROBE_TEXT tokenized by the model's own tokenizer."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(model_path)).encode(PROBE_TEXT))


def probe_body(token_ids: Sequence[int], lora_name: str) -> dict:
    """A native /generate that scores every token of the probe under `lora_name` and generates one token."""
    return {
        "input_ids": list(token_ids),
        "lora_path": lora_name,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
    }


async def engine_log_probs(client: EngineClient, token_ids: Sequence[int], lora_name: str) -> list[float]:
    """The engine's logprob of each probe token after the first (the first has none: nothing precedes it)."""
    out = cast(dict[str, Any], await client.generate(probe_body(token_ids, lora_name)))  # one prompt: one result
    triples = out["meta_info"]["input_token_logprobs"]
    return [float(t[0]) for t in triples[1:]]


def mean_gap(engine: Sequence[float], trainer: Sequence[float]) -> float:
    if len(engine) != len(trainer) or not trainer:
        raise SyncVerificationError(
            f"the probe scored {len(engine)} tokens on the engine and {len(trainer)} on "
            "the trainer; they must score the same tokens"
        )
    return sum(abs(a - b) for a, b in zip(engine, trainer, strict=True)) / len(trainer)


@dataclass(frozen=True)
class ProbeReport:
    gaps: list[float]  # per engine, in the order of the clients
    seconds: float


class PushProbe:
    """Scores PROBE tokens on every engine after a push and compares with the trainer (plan.weight_sync.verify)."""

    def __init__(self, clients: Sequence[EngineClient], token_ids: Sequence[int], max_gap: float) -> None:
        self.clients, self.token_ids, self.max_gap = list(clients), list(token_ids), max_gap

    async def check(self, trainer_log_probs: Sequence[float], lora_name: str, *, what: str) -> ProbeReport:
        """SyncVerificationError naming `what` (the push), each engine beyond weight_sync.max_logprob_gap, and
        its gap; the gaps otherwise."""
        started = time.perf_counter()
        scored = await asyncio.gather(*(engine_log_probs(c, self.token_ids, lora_name) for c in self.clients))
        gaps = [mean_gap(engine, trainer_log_probs) for engine in scored]
        wrong = [
            f"engine {c.base_url} differs by {g:.4g}"
            for c, g in zip(self.clients, gaps, strict=True)
            if not g <= self.max_gap
        ]
        if wrong:
            raise SyncVerificationError(
                f"{what}: the probe of adapter {lora_name!r} ({len(trainer_log_probs)} tokens, mean |trainer - "
                f"engine| logprob) is above weight_sync.max_logprob_gap={self.max_gap:g}: "
                + "; ".join(wrong)
                + ". The engine does not serve the adapter that was pushed; nothing is trained after this push."
            )
        return ProbeReport(gaps, time.perf_counter() - started)
