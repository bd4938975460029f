"""bench/multi_lora_throughput.py's engine case against a real engine: the producer's groups are counted (a case whose
rollout is handed an engine client where a worker pool belongs measures 0 tokens/s without failing)."""

from __future__ import annotations

import pytest

from bench import multi_lora_throughput as bench

pytestmark = pytest.mark.integration


def test_the_engine_case_counts_the_groups_and_tokens_the_producer_made():
    figures = bench.engine_rate(1, seconds=1.0, warmup_s=0.5)
    assert figures["engine_groups_per_s"] > 0
    assert figures["engine_tokens_per_s"] >= figures["engine_groups_per_s"] * bench.N  # one token per sample at least
