"""Routing and indexer replay need a model that has expert routing or a sparse-attention indexer."""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived
from miles_runner.plan.rules.base import Finding, rule


@rule("routing-replay-needs-moe")
def routing_replay_needs_moe(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.routing_replay and not d.is_moe:
        yield Finding(
            ("rollout.routing_replay", "model.num_experts"),
            f"{cfg.model.name} is dense: there is no expert routing to replay.",
            "rollout.routing_replay=false",
        )


@rule("indexer-replay-needs-dsa")
def indexer_replay_needs_dsa(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.rollout.indexer_replay:
        return
    if not cfg.model.has_dsa_indexer:
        yield Finding(
            ("rollout.indexer_replay", "model.has_dsa_indexer"),
            f"{cfg.model.name} has no sparse-attention indexer whose top-k could be replayed.",
            "rollout.indexer_replay=false",
        )
    if cfg.trainer.parallel.cp != 1:
        yield Finding(
            ("rollout.indexer_replay", "trainer.parallel.cp"),
            "Indexer replay needs the whole sequence on one rank.",
            "trainer.parallel.cp=1",
        )
