"""The session server and the pause mode it needs (docs/system.md §1.2 rules 1-6)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.core.tiny_shapes import TINY_TOKENS
from miles_runner.core.tito_families import TITO_FAMILIES
from miles_runner.plan.derive import Derived, parse_tiny_model
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


# The TITO family each tiny model's tokenizer renders (models/tiny_model.py): ChatML, or GLM-4.7's for tiny-glm5.
TINY_FAMILIES = {"tiny-glm5": "glm47"}


@rule("tito-model-fits-tokenizer")
def tito_model_fits_tokenizer(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    family = TITO_FAMILIES[cfg.session.tito_model]
    tiny = parse_tiny_model(cfg.model.path)
    if cfg.session.version == "off" or tiny is None:
        return
    have = TINY_TOKENS.get(tiny[0], ())
    if not set(family.required_tokens) <= set(have):
        fits = TINY_FAMILIES.get(tiny[0], "qwen3")
        yield Finding(
            ("session.tito_model", "model.path"),
            f"tito_model {family.name} renders with its chat template and the role tokens "
            f"{list(family.required_tokens)}; {tiny[0]}'s tokenizer ({fits}'s template) lacks them.",
            f"session.tito_model={fits}",
        )


@rule("tito-model-needs-trim")
def tito_model_needs_trim(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    s = cfg.session
    family = TITO_FAMILIES[s.tito_model]
    if s.version != "off" and s.max_trim_tokens < family.max_trim_tokens:
        yield Finding(
            ("session.tito_model", "session.max_trim_tokens"),
            f"tito_model {family.name} drops the token that ends a generated turn when the next message opens "
            "with it, so the stored ids may lose that many tokens.",
            f"session.max_trim_tokens={family.max_trim_tokens}",
        )


@rule("session-needs-adapter-on-engines")
def session_needs_adapter_on_engines(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and d.lora_enabled and cfg.adapters.train_only:
        yield Finding(
            (SESSION, "adapters.train_only"),
            "The session server attaches the adapter to every turn, but train_only never loads it on the engines.",
            "adapters.train_only=false",
        )


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@rule("session-open-to-the-network-needs-key")
def session_open_to_the_network_needs_key(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and cfg.session.host in WILDCARD_HOSTS and not cfg.security.api_key_env:
        yield Finding(
            ("session.host", "security.api_key_env"),
            f"session.host={cfg.session.host!r} listens on every interface, so anyone on the network could "
            "open sessions and drive the engines through them, and the run has no key.",
            "session.host=127.0.0.1 (agents on this machine), or set security.api_key_env (SECURITY.md)",
        )


@rule("session-limits-fit-rollout")
def session_limits_fit_rollout(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    s, r = cfg.session, cfg.rollout
    if s.max_sessions < 1:
        yield Finding(
            ("session.max_sessions",),
            "session.max_sessions caps the open sessions; it must be at least 1.",
            "session.max_sessions=1024",
        )
    if not 0 < s.max_age_s < math.inf:
        yield Finding(
            ("session.max_age_s",),
            "session.max_age_s is a session's lifetime in seconds; it must be a positive, finite number.",
            "session.max_age_s=3600",
        )
    episodes = r.rollout_batch_size * r.n_samples_per_prompt
    if s.version != "off" and 1 <= s.max_sessions < episodes:
        yield Finding(
            ("session.max_sessions", "rollout.rollout_batch_size", "rollout.n_samples_per_prompt"),
            f"A rollout plays its {episodes} episodes at once, one session each, above session.max_sessions="
            f"{s.max_sessions}: the session server would refuse the rest with a 429.",
            f"session.max_sessions={episodes}",
        )
