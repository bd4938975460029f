"""The embedded engine's request limits (engine.max_n, engine.max_batch_size) fit the requests the run sends.

The single-turn rollout sends each prompt's group as one batch /generate of `rollout.n_samples_per_prompt` items;
those samples are the prompt's n. A plan whose groups exceed a limit would have every rollout refused with a 400,
so it is refused here. SGLang has no such limits: on an SGLang engine the settings would be enforced by nothing,
so a plan that changes them is refused rather than left to claim a limit it does not have.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import EngineConfig, MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import Finding, rule

LIMITS = ("max_n", "max_batch_size")
SAMPLES = "rollout.n_samples_per_prompt"


@rule("rollout-within-engine-limits")
def rollout_within_engine_limits(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    for name in LIMITS:
        limit = getattr(cfg.engine, name)
        if limit < 1:
            yield Finding(
                (f"engine.{name}",),
                f"engine.{name} is a request limit; it must be at least 1.",
                f"engine.{name}={getattr(EngineConfig, name)}",
            )
        elif cfg.engine.kind == "embedded" and cfg.rollout.n_samples_per_prompt > limit:
            yield Finding(
                (SAMPLES, f"engine.{name}"),
                f"Each prompt's {cfg.rollout.n_samples_per_prompt} samples go to the engine as one request, above "
                f"its limit engine.{name}={limit}: the engine would refuse every rollout request with a 400.",
                f"engine.{name}={cfg.rollout.n_samples_per_prompt}",
            )


@rule("sglang-engine-has-no-request-limits")
def sglang_engine_has_no_request_limits(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind != "sglang":
        return
    for name in LIMITS:
        default = getattr(EngineConfig, name)
        if getattr(cfg.engine, name) != default:
            yield Finding(
                ("engine.kind", f"engine.{name}"),
                f"engine.{name} is a limit of the embedded engine; SGLang has no such launch flag, so an SGLang "
                "engine would not enforce it.",
                f"engine.{name}={default}",
            )
