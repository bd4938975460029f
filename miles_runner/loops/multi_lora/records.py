"""Step records (metrics.jsonl, through tracking.Tracker) with per-adapter namespaces (`{adapter}/reward/mean`,
`{adapter}/train/loss`, `{adapter}/step`, ...), the token rate, and per-adapter plots at the end of a run."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.collect import TrainBatch
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.plan.model import Plan
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.session.samples import Sample
from miles_runner.tracking.metrics import MetricsFile
from miles_runner.tracking.plots import plot_metrics
from miles_runner.tracking.tracker import Tracker

SlotMetrics = dict[int, dict[str, float]]  # the trainer's metrics of one batch, by slot
OPTIONAL_TRAIN_METRICS = (
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "rollout_logprob_abs_diff",
    "routing_replay_diff_frac",
)


def first_iteration(run_dir: Path, resume: bool) -> int:
    """0, or on a resume the iteration after the last one metrics.jsonl records."""
    done = MetricsFile(run_dir / "metrics.jsonl").read() if resume else []
    return done[-1]["step"] + 1 if done else 0


def make_tracker(plan: Plan, run_dir: Path, start: int) -> Tracker:
    """tracking.Tracker, with the iteration count it can expect: every plan adapter's steps, in global batches."""
    samples = sum(
        (a.num_step or plan.batch.num_steps) * a.rollout_batch_size * a.n_samples_per_prompt for a in plan.adapters
    )
    iterations = max(start + 1, -(-samples // plan.batch.global_batch_size))
    shown = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, num_steps=iterations))
    return Tracker(shown, run_dir, start_step=start)


class StepRecords:
    """Builds each iteration's record: the batch's rewards and per-adapter train metrics, plus the rollout's and
    buffers' running counters (tokens per second, dropped groups, aborted samples)."""

    def __init__(self, rollout: MultiLoRARollout, buffers: AdapterBuffers) -> None:
        self.rollout, self.buffers = rollout, buffers
        self._rate_mark: tuple[float | None, int] = (None, 0)  # (time, tokens generated) at the last record

    def record(
        self,
        iteration: int,
        snapshot: RegistrySnapshot,
        batch: TrainBatch,
        metrics: SlotMetrics,
        steps: dict[str, int],
        timings: dict[str, float],
    ) -> dict[str, Any]:
        """`metrics` are the trainer's, by slot; `steps` the step each adapter that stepped has reached."""
        samples = batch.samples
        record: dict[str, Any] = {
            "step": iteration,
            "reward/mean": sum(s.reward or 0.0 for s in samples) / len(samples),
            "batch/samples": len(samples),
            "rollout/tokens_per_s": self._token_rate(),
            **timings,
        }
        for name, groups in batch.group_counts.items():
            record[f"{name}/groups"] = groups
            record.update(_train_metrics(name, metrics[snapshot.sampleable[name].slot]))
        record.update({f"{name}/step": step for name, step in steps.items()})
        record.update(self._counters(samples))
        return record

    def _counters(self, samples: list[Sample]) -> dict[str, float]:
        """Per adapter: groups dropped (by reason) and samples aborted so far, mean turns of this batch."""
        counters: dict[str, float] = {}
        for (name, reason), count in self.buffers.dropped.items():
            counters[f"{name}/dropped/{reason}"] = count
        for name, count in self.rollout.aborted.items():
            counters[f"{name}/rollout/aborted"] = count
        for name, turns in _mean_by_adapter(samples, "turns").items():
            counters[f"{name}/rollout/turns_mean"] = turns
        return counters

    def _token_rate(self) -> float:
        """Tokens generated (all adapters) per second since the previous record."""
        now, tokens = time.perf_counter(), self.rollout.tokens_generated
        last_t, last_tokens = self._rate_mark
        self._rate_mark = (now, tokens)
        return 0.0 if last_t is None else (tokens - last_tokens) / max(now - last_t, 1e-9)


def _train_metrics(name: str, slot_metrics: dict[str, float]) -> dict[str, float]:
    """One adapter's share of the trainer's metrics (its slot's), under its namespace."""
    metrics = {
        f"{name}/reward/mean": slot_metrics["reward_mean"],
        f"{name}/train/loss": slot_metrics["loss"] / slot_metrics["samples"],
    }
    for key in OPTIONAL_TRAIN_METRICS:
        if key in slot_metrics:
            metrics[f"{name}/train/{key}"] = slot_metrics[key]
    return metrics


def _mean_by_adapter(samples: list[Sample], key: str) -> dict[str, float]:
    """The mean of a sample metadata field per adapter, over the samples that carry it (agentic episodes)."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        if key in sample.metadata:
            values.setdefault(sample.metadata["adapter"], []).append(float(sample.metadata[key]))
    return {name: sum(v) / len(v) for name, v in values.items()}


def plot_adapters(plan: Plan, records: list[dict[str, Any]], run_dir: Path) -> None:
    """metrics_{adapter}.png for every adapter with a reward in the records (the run's own plot is Tracker's)."""
    if not (plan.logger.plots and records):
        return
    names = sorted({key.removesuffix("/reward/mean") for r in records for key in r if key.endswith("/reward/mean")})
    for name in names:
        plot_metrics(records, run_dir / f"metrics_{name}.png", prefix=f"{name}/")
