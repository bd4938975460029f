"""Fully-async rollout and the async schedule: disaggregated roles, resumable pauses, off-policy correction
(docs/system.md §1.2 rules 7-8).
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import ADAPTERS, PAUSE, TOPOLOGY, Finding, rule


@rule("fully-async-needs-disaggregated")
def fully_async_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and d.colocated:
        yield Finding(
            ("rollout.fully_async", TOPOLOGY),
            "Fully-async rollout keeps generating while training runs; colocated roles take turns on the GPUs.",
            "topology=disaggregated",
        )


@rule("fully-async-needs-resumable-pause")
def fully_async_needs_resumable_pause(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and cfg.weight_sync.pause_generation_mode == "abort":
        yield Finding(
            ("rollout.fully_async", PAUSE),
            "Every weight update would abort the generation that fully-async exists to keep running.",
            "pause_generation_mode=retract",
        )


@rule("fully-async-single-adapter")
def fully_async_single_adapter(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and d.multi_lora:
        yield Finding(
            ("rollout.fully_async", ADAPTERS),
            "Multi-LoRA has its own asynchronous producer; the fully-async rollout cannot drive it.",
            "rollout.fully_async=false",
        )


@rule("fully-async-no-partial-rollout")
def fully_async_no_partial_rollout(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.rollout.fully_async:
        return
    for key in ("partial_rollout", "recompute_logprobs_via_prefill"):
        if getattr(cfg.rollout, key):
            yield Finding(
                ("rollout.fully_async", f"rollout.{key}"),
                f"The fully-async rollout function does not support {key}.",
                f"rollout.{key}=false",
            )


@rule("fully-async-needs-async-driver")
def fully_async_needs_async_driver(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and cfg.rollout.schedule != "async":
        yield Finding(
            ("rollout.fully_async", "rollout.schedule"),
            "Fully-async rollout runs only under the asynchronous schedule (train_async).",
            "rollout.schedule=async",
        )


@rule("async-driver-needs-disaggregated")
def async_driver_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.schedule == "async" and d.colocated:
        yield Finding(
            ("rollout.schedule", TOPOLOGY),
            "The async schedule generates step n+1 while training step n; colocated roles cannot run at once.",
            "topology=disaggregated",
        )


def corrects_off_policy(cfg: MilesConfig) -> bool:
    """The loss can train on samples from older weights: rollout logprobs, TIS or the old actor."""
    a = cfg.algorithm
    return a.use_rollout_logprobs or a.use_tis or cfg.trainer.keep_old_actor


@rule("async-needs-off-policy-correction")
def async_needs_off_policy_correction(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.schedule == "async" and not corrects_off_policy(cfg):
        yield Finding(
            ("rollout.schedule", "algorithm.use_tis"),
            "Async samples come from weights one step old; the loss needs rollout logprobs, TIS or the old actor.",
            "algorithm.use_tis=true",
        )


@rule("async-driver-is-one-step-stale")
def async_driver_is_one_step_stale(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    # A longer update interval adds to this bound: update-interval-within-staleness (weight_sync.py) says so.
    interval = cfg.weight_sync.update_weights_interval
    if cfg.rollout.schedule == "async" and interval == 1 and cfg.rollout.max_weight_staleness < 1:
        yield Finding(
            ("rollout.schedule", "rollout.max_weight_staleness"),
            "The async schedule trains on samples one weight version old; staleness 0 would reject every batch.",
            "rollout.max_weight_staleness=1",
        )
