"""bench/r3_merge_speed.py's synthetic session: records in the session server's format, each asking for the rows
the server's own rule gives, carrying between them exactly the session's routing."""

from __future__ import annotations

import itertools

import numpy as np

from bench import r3_merge_speed as bench
from miles_runner.session.r3 import addition_r3_start_len, assemble_incremental_r3, record_row_span


def test_every_turn_starts_where_the_session_server_would_ask():
    records, _ = bench.session_records(turns=6)
    checkpoint: list[int] = []
    for record in records:
        assert record.request["routed_experts_start_len"] == addition_r3_start_len(checkpoint, record.prompt_ids)
        checkpoint = [*record.prompt_ids, *record.output_ids]


def test_the_records_carry_the_whole_routing_once():
    records, routing = bench.session_records(turns=6)
    spans = [record_row_span(record) for record in records]
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == len(routing)
    assert np.array_equal(assemble_incremental_r3(records, len(routing), bench.NUM_LAYERS), routing)


def test_the_default_session_has_the_stated_size():
    lengths = bench.turn_lengths(bench.TURNS)
    assert len(lengths) == 50 and lengths[0][0] == bench.FIRST_PROMPT
    assert all(bench.OBSERVATION[0] <= added <= bench.OBSERVATION[1] for added, _ in lengths[1:])
    assert all(bench.RESPONSE[0] <= response <= bench.RESPONSE[1] for _, response in lengths)
    tokens = sum(added + response for added, response in lengths)
    assert 30_000 < tokens < 34_000  # fills a 32k context
