"""Every adapter push is verified: a push that silently does nothing (an adapter never updated, a dropped shard)
stops the run before anything trains on what it generated.

Two checks, both named in the plan's `verify` row:
- versions (always): after a push every engine, asked itself rather than through the router, reports the pushed
  weight version (AdapterSync.push runs it).
- logprob gap (plan.sync.verify): the first batch generated entirely at a pushed version is scored by the trainer
  before it trains on that batch, while the trainer still holds exactly what it pushed. The mean
  |trainer - rollout| logprob over trained tokens must stay within plan.sync.max_logprob_gap: an engine serving
  other weights than the pushed ones (a frozen adapter, a lost shard) shows here even when its version is right.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from miles_runner.engine.client import EngineClient


class SyncVerificationError(RuntimeError):
    """A push the engines did not take: the run stops here and trains on nothing generated after it."""


class ScoredSample(Protocol):
    loss_mask: list[int]
    rollout_log_probs: list[float]
    weight_versions: list[str]


async def check_engine_versions(clients: Sequence[EngineClient], version: int) -> None:
    """Raise SyncVerificationError naming every engine that does not report `version`."""
    versions = await asyncio.gather(*(client.weight_version() for client in clients))
    wrong = [f"engine {c.base_url} reports {v!r}" for c, v in zip(clients, versions, strict=True) if v != str(version)]
    if wrong:
        raise SyncVerificationError(f"the push of weight version {version} did not reach every engine: "
                                    + "; ".join(wrong))  # fmt: skip


def generated_since(sample: ScoredSample, version: int) -> bool:
    """Whether every token of the sample came from weight version `version` or a later one."""
    return bool(sample.weight_versions) and all(int(v) >= version for v in sample.weight_versions)


def logprob_gap(samples: Sequence[ScoredSample], trainer_log_probs: Sequence[Sequence[float]]) -> float:
    """Mean |trainer - rollout| logprob over the trained (loss-mask) response tokens."""
    total, tokens = 0.0, 0
    for sample, mine in zip(samples, trainer_log_probs, strict=True):
        if len(sample.rollout_log_probs) != len(mine):
            raise SyncVerificationError("a sample carries no rollout logprobs for its response tokens, so its push "
                                        "cannot be verified; the rollout must return logprobs")  # fmt: skip
        for trained, rollout, trainer in zip(sample.loss_mask, sample.rollout_log_probs, mine, strict=True):
            if trained:
                total, tokens = total + abs(trainer - rollout), tokens + 1
    return total / max(tokens, 1)


class GapCheck:
    """The logprob-gap check of the latest push, due on the first samples generated entirely since it.

    A sample reports only the version each turn ended under, which tells the samples apart exactly when no
    generation is in flight across a push: the sync driver (the plan refuses the check elsewhere)."""

    def __init__(self, max_gap: float, engines: Sequence[str]) -> None:
        self.max_gap, self.engines = max_gap, list(engines)
        self.version: int | None = None  # the push still to verify

    def pushed(self, version: int) -> None:
        self.version = version

    def fresh(self, samples: Sequence[ScoredSample]) -> list[ScoredSample]:
        """The samples a check of the pending push scores: those generated entirely since it (none: not due)."""
        version = self.version
        return [] if version is None else [s for s in samples if generated_since(s, version)]

    def check(self, samples: Sequence[ScoredSample], trainer_log_probs: Sequence[Sequence[float]], *,
              what: str) -> float:  # fmt: skip
        """The gap of the `fresh` samples, scored by the trainer at the pushed weights; SyncVerificationError when
        it exceeds the tolerance. `what` names the batch (the step, the adapter) in the error."""
        gap = logprob_gap(samples, trainer_log_probs)
        version, self.version = self.version, None
        if gap > self.max_gap:
            raise SyncVerificationError(
                f"{what}: the first samples generated with weight version {version} (by {self._engines()}) differ "
                f"from the trainer's logprobs by {gap:.4g} on average, above weight_sync.max_logprob_gap="
                f"{self.max_gap:g}: the engines do not serve the adapter that was pushed. Nothing was trained on it."
            )
        return gap

    def _engines(self) -> str:
        if len(self.engines) == 1:
            return f"engine {self.engines[0]}"
        return f"engines {', '.join(self.engines)}, which share the batch"
