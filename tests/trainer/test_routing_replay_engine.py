"""Routing replay against the real embedded engine: the runner's single-turn rollout brings the engine's rows, and
the trainer/engine log-prob gap with replay is no larger than without it, before and after the routers move
(figures: bench/routing_replay_gap.py)."""

from __future__ import annotations

import pytest

from miles_runner.models.moe_routing import routing_layout
from miles_testkit.routing_gap import engine_samples, measure_gaps, r3_engine, r3_plan, trainers

pytestmark = pytest.mark.integration

PROMPTS = 4
MOVED = 0.1  # std of the noise added to every gate weight (they are initialised with std 0.1)


@pytest.fixture(scope="module")
def plan():
    return r3_plan()


@pytest.fixture(scope="module")
def samples(plan, tmp_path_factory):
    with r3_engine(plan, tmp_path_factory.mktemp("engine")) as url:
        return engine_samples(plan, url, PROMPTS)


@pytest.fixture(scope="module")
def gaps(plan, samples):
    return measure_gaps(plan, samples, (0.0, MOVED))


def test_single_turn_samples_carry_the_engines_rows_for_every_token_but_the_last(plan, samples):
    layout = routing_layout(trainers(plan)["replay"].model)
    assert len(samples) == PROMPTS * plan.batch.n_samples_per_prompt
    for sample in samples:
        rows = sample.rollout_routed_experts
        assert rows.shape == (len(sample.tokens) - 1, layout.num_layers, layout.top_k) and rows.dtype == "int32"


def test_the_gap_with_replay_is_no_larger_when_the_routers_are_the_rollouts(gaps):
    assert gaps[0.0]["replay"]["mean"] <= gaps[0.0]["own routing"]["mean"]


def test_the_gap_with_replay_is_smaller_once_the_routers_moved(gaps):
    assert gaps[MOVED]["replay"]["mean"] < gaps[MOVED]["own routing"]["mean"]
    assert gaps[MOVED]["own routing"]["mean"] > gaps[0.0]["own routing"]["mean"]  # the move mattered
