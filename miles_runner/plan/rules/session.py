"""The session server and the pause mode it needs (spec §1.2 rules 1-6)."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import PAUSE, Finding, rule

SESSION = "session.version"


@rule("session-needs-resumable-pause")
def session_needs_resumable_pause(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and cfg.weight_sync.pause_generation_mode == "abort":
        yield Finding(
            (SESSION, PAUSE),
            "An agent's turn in flight would be killed at every weight update. Use in_place or retract.",
            "pause_generation_mode=in_place",
        )


@rule("session-v2-returns-sample-lists")
def session_v2_returns_sample_lists(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "v2":
        return
    for key in ("group_rm", "partial_rollout", "recompute_logprobs_via_prefill"):
        if getattr(cfg.rollout, key):
            yield Finding(
                (SESSION, f"rollout.{key}"),
                f"The v2 session server returns a list of samples per session, which {key} cannot handle.",
                f"rollout.{key}=false",
            )


@rule("tito-model-needs-session")
def tito_model_needs_session(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.tito_model != "default" and cfg.session.version == "off":
        yield Finding(
            ("session.tito_model", SESSION),
            "A TITO model family only shapes how the session server tokenizes turns; there is no session server.",
            "session=v1",
        )


@rule("session-needs-adapter-on-engines")
def session_needs_adapter_on_engines(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and d.lora_enabled and cfg.adapters.train_only:
        yield Finding(
            (SESSION, "adapters.train_only"),
            "The session server attaches the adapter to every turn, but train_only never loads it on the engines.",
            "adapters.train_only=false",
        )
