"""The adapter push cadence and what checks each push: weight_sync.update_weights_interval, the staleness it
implies (rollout.max_weight_staleness), and the verification of pushes (weight_sync.verify,
weight_sync.max_logprob_gap, weight_sync.check_weight_equal).

The loops push after every `update_weights_interval` steps and after the last one (train_async.py's
`(rollout_id + 1) % interval == 0`; the sync schedule honours it the same way here), so a trained batch lags the
trainer by up to interval - 1 versions, plus one under the async schedule (plan.model.staleness_bound).
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.model import DEFAULT_MAX_LOGPROB_GAP, staleness_bound
from miles_runner.plan.rules.base import ADAPTERS, Finding, rule
from miles_runner.plan.rules.fully_async import corrects_off_policy

INTERVAL = "weight_sync.update_weights_interval"
STALENESS = "rollout.max_weight_staleness"
SCHEDULE = "rollout.schedule"
VERIFY = "weight_sync.verify"
MAX_GAP = "weight_sync.max_logprob_gap"


@rule("update-interval-positive", precondition=True)
def update_interval_positive(cfg: MilesConfig, d: Derived | None) -> Iterator[Finding]:
    if cfg.weight_sync.update_weights_interval < 1:
        yield Finding(
            (INTERVAL,),
            f"{INTERVAL} counts training steps between adapter pushes; it must be at least 1.",
            f"{INTERVAL}=1",
        )


@rule("update-interval-within-staleness")
def update_interval_within_staleness(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    interval, schedule = cfg.weight_sync.update_weights_interval, cfg.rollout.schedule
    bound = staleness_bound(interval, schedule)
    if interval > 1 and bound > cfg.rollout.max_weight_staleness:
        why = f"{interval} - 1 steps between pushes" + (
            ", plus one for the async schedule" if schedule == "async" else ""
        )
        yield Finding(
            (INTERVAL, *((SCHEDULE,) if schedule == "async" else ()), STALENESS),
            f"Pushing the adapter every {interval} steps trains batches up to {bound} weight versions old ({why}); "
            f"{STALENESS}={cfg.rollout.max_weight_staleness} would reject them.",
            f"{STALENESS}={bound}",
        )


@rule("update-interval-needs-off-policy-correction")
def update_interval_needs_off_policy_correction(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    # The async schedule's batches are stale whatever the interval: async-needs-off-policy-correction says so.
    interval = cfg.weight_sync.update_weights_interval
    if interval > 1 and cfg.rollout.schedule == "sync" and not corrects_off_policy(cfg):
        yield Finding(
            (INTERVAL, "algorithm.use_tis"),
            f"Between pushes, batches come from adapter weights up to {interval - 1} steps older than the trainer's; "
            "the loss needs rollout logprobs, TIS or the old actor to correct for that.",
            "algorithm.use_tis=true",
        )


@rule("multi-lora-pushes-every-step")
def multi_lora_pushes_every_step(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.multi_lora and cfg.weight_sync.update_weights_interval > 1:
        yield Finding(
            (INTERVAL, ADAPTERS),
            "The multi-LoRA loop (train_multi_lora_async) pushes each adapter after every step it takes, and its "
            f"staleness filter ({STALENESS}) counts those pushes: pushing every N steps would let batches N times "
            "older through than the filter says.",
            f"{INTERVAL}=1",
        )


@rule("max-logprob-gap-positive")
def max_logprob_gap_positive(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    gap = cfg.weight_sync.max_logprob_gap
    if gap is not None and not gap > 0:
        yield Finding(
            (MAX_GAP,),
            "Trainer and engine logprobs never agree to the last bit (other kernels, batch shapes, precision): "
            "the tolerance must be above 0.",
            f"{MAX_GAP}={DEFAULT_MAX_LOGPROB_GAP[cfg.engine.kind]:g}",
        )


@rule("check-weight-equal-cannot-read-adapters")
def check_weight_equal_cannot_read_adapters(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.weight_sync.check_weight_equal and d.lora_enabled:
        yield Finding(
            ("weight_sync.check_weight_equal", ADAPTERS),
            "SGLang 0.5.23 cannot read an adapter back: /weights_checker and /get_weights_by_name see the base "
            "model's parameters only (LoRA weights live in its adapter memory pool), and miles's own check compares "
            "base weights (its LoRA checker is a TODO). Each adapter push is checked instead: every engine must "
            f"report the pushed weight version, and {VERIFY} bounds every engine's logprob gap on a probe.",
            "weight_sync.check_weight_equal=false",
        )
