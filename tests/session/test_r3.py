import numpy as np
import pytest
from session_records import NUM_LAYERS, incremental_records, make_record, routing_rows

from miles_runner.session.errors import TokenizationError
from miles_runner.session.r3 import addition_r3_start_len, assemble_incremental_r3
from miles_runner.sglang_client.routed_experts import encode_routed_experts

# Two turns: prompt 4 + completion 3 (7 tokens), then the 7 + observation 2 + completion 3 (12 tokens).
TURN_1 = ([1, 2, 3, 4], [5, 6, 7])
TURN_2 = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12])


def test_first_turn_asks_for_every_row():
    assert addition_r3_start_len([], [1, 2, 3]) == 0


def test_later_turn_asks_from_the_checkpoint_length_minus_one():
    assert addition_r3_start_len([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7]) == 4


def test_start_len_rejects_a_prompt_that_rewrites_the_checkpoint():
    with pytest.raises(TokenizationError, match="differ at token 2"):
        addition_r3_start_len([1, 2, 3, 4], [1, 2, 9, 4, 5])


def test_two_patches_rebuild_the_full_tensor_byte_for_byte():
    records = incremental_records([TURN_1, TURN_2])
    assembled = assemble_incremental_r3(records, required_rows=11, num_layers=NUM_LAYERS)
    assert assembled.dtype == np.int32
    assert assembled.tobytes() == routing_rows(11).tobytes()


def test_assembly_stops_at_the_rows_the_sample_needs():
    records = incremental_records([TURN_1, TURN_2])
    assembled = assemble_incremental_r3(records, required_rows=5, num_layers=NUM_LAYERS)
    assert assembled.tobytes() == routing_rows(5).tobytes()


def test_an_overlap_names_the_turn_and_rows():
    first = incremental_records([TURN_1])[0]
    overlapping = make_record(*TURN_2, start_len=4, routed=routing_rows(7, offset=4))
    with pytest.raises(ValueError, match=r"turn 1 starts at row 4 .* overlaps rows \[4, 6\)"):
        assemble_incremental_r3([first, overlapping], required_rows=11, num_layers=NUM_LAYERS)


def test_a_gap_names_the_turn_and_rows():
    first = incremental_records([TURN_1])[0]
    gapped = make_record(*TURN_2, start_len=8, routed=routing_rows(3, offset=8))
    with pytest.raises(ValueError, match=r"turn 1 starts at row 8 .* gap over rows \[6, 8\)"):
        assemble_incremental_r3([first, gapped], required_rows=11, num_layers=NUM_LAYERS)


def test_a_record_without_start_len_is_rejected():
    first = incremental_records([TURN_1])[0]
    no_start = make_record(*TURN_2, routed=routing_rows(11))
    with pytest.raises(ValueError, match="turn 1 was sent without routed_experts_start_len"):
        assemble_incremental_r3([first, no_start], required_rows=11, num_layers=NUM_LAYERS)


def test_a_missing_payload_is_rejected():
    first = incremental_records([TURN_1])[0]
    missing = make_record(*TURN_2, start_len=6)
    with pytest.raises(ValueError, match=r"turn 1 has no routed_experts payload for rows \[6, 11\)"):
        assemble_incremental_r3([first, missing], required_rows=11, num_layers=NUM_LAYERS)


def test_a_payload_with_the_wrong_row_count_is_rejected():
    first = incremental_records([TURN_1])[0]
    short = make_record(*TURN_2, start_len=6, routed=routing_rows(4, offset=6))
    with pytest.raises(ValueError, match=r"turn 1 rows \[6, 11\)"):
        assemble_incremental_r3([first, short], required_rows=11, num_layers=NUM_LAYERS)


def test_a_bad_payload_is_reported_before_a_gap_in_a_later_turn():
    # The stream is checked before any patch is decoded, but errors still come in turn order.
    first = incremental_records([TURN_1])[0]
    short = make_record(*TURN_2, start_len=6, routed=routing_rows(4, offset=6))
    gapped = make_record([*TURN_2[0], 10, 11, 12, 13], [14], start_len=13, routed=routing_rows(4, offset=13))
    with pytest.raises(ValueError, match=r"R3: turn 1 rows \[6, 11\)"):
        assemble_incremental_r3([first, short, gapped], required_rows=16, num_layers=NUM_LAYERS)


def test_many_patches_placed_side_by_side_rebuild_the_tensor():
    # Turns of one to three tokens each: dozens of patches go through the merge's thread pool.
    rng = np.random.default_rng(0)
    turns, prompt = [], [1]
    for _ in range(40):
        prompt = prompt + [int(t) for t in rng.integers(2, 99, int(rng.integers(1, 3)))]
        output = [int(t) for t in rng.integers(2, 99, int(rng.integers(1, 3)))]
        turns.append((prompt, output))
        prompt = prompt + output
    required = len(prompt) - 1
    merged = assemble_incremental_r3(incremental_records(turns), required, NUM_LAYERS)
    assert merged.tobytes() == routing_rows(required).tobytes()


def test_an_empty_payload_for_a_non_empty_delta_is_rejected():
    record = make_record(*TURN_1, start_len=0)
    record.meta_info["routed_experts"] = ""
    with pytest.raises(ValueError, match=r"turn 0 carries an empty payload for 6 rows"):
        assemble_incremental_r3([record], required_rows=6, num_layers=NUM_LAYERS)


def test_an_empty_delta_keeps_the_layer_axis():
    record = make_record([1], [], start_len=0)
    record.meta_info["routed_experts"] = ""
    assembled = assemble_incremental_r3([record], required_rows=0, num_layers=NUM_LAYERS)
    assert assembled.shape == (0, NUM_LAYERS, 0)


def test_patches_that_disagree_on_topk_are_rejected():
    first = incremental_records([TURN_1])[0]
    wider = np.zeros((5, NUM_LAYERS, 4), dtype=np.int32)
    second = make_record(*TURN_2, start_len=6)
    second.meta_info["routed_experts"] = encode_routed_experts(wider)
    with pytest.raises(ValueError, match="disagree on top-k"):
        assemble_incremental_r3([first, second], required_rows=11, num_layers=NUM_LAYERS)


def test_too_few_rows_for_the_sample_is_rejected():
    records = incremental_records([TURN_1])
    with pytest.raises(ValueError, match=r"cover rows \[0, 6\) but the sample needs 11"):
        assemble_incremental_r3(records, required_rows=11, num_layers=NUM_LAYERS)


# ----- the merge against a plain concatenation of every decoded patch ---------------------------------------
def _reference_merge(records, required_rows: int, num_layers: int) -> np.ndarray:
    """What the merge must give: every record's decoded patch, concatenated in order, cut at required_rows."""
    from miles_runner.session.r3 import decode_record_r3

    patches = [decode_record_r3(record, turn, num_layers) for turn, record in enumerate(records)]
    return np.concatenate([p for p in patches if len(p)])[:required_rows]


def _random_session(rng: np.random.Generator, num_layers: int, topk: int):
    """Records of a random incremental-R3 session (some turns with no new rows) and its full routing."""
    turns = int(rng.integers(1, 8))
    added = [int(rng.integers(1, 40)), *(int(n) for n in rng.integers(0, 20, turns - 1))]
    outputs = [int(n) for n in rng.integers(1, 20, turns)]
    total = sum(added) + sum(outputs)
    routing = rng.integers(0, 64, (total - 1, num_layers, topk), dtype=np.int32)
    records, length = [], 0
    for new_prompt, new_output in zip(added, outputs, strict=True):
        prompt = list(range(length + new_prompt))
        start, length = max(0, length - 1), length + new_prompt + new_output
        patch = routing[start : length - 1]
        records.append(make_record(prompt, list(range(new_output)), start_len=start, routed=patch))
    return records, routing


@pytest.mark.parametrize("seed", range(20))
def test_merge_equals_the_concatenated_patches_on_random_sessions(seed):
    rng = np.random.default_rng(seed)
    num_layers, topk = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    records, routing = _random_session(rng, num_layers, topk)
    required = int(rng.integers(0, len(routing) + 1))
    merged = assemble_incremental_r3(records, required, num_layers)
    expected = _reference_merge(records, required, num_layers)
    assert merged.dtype == np.int32 and merged.shape == expected.shape == (required, num_layers, topk)
    assert merged.tobytes() == expected.tobytes() == routing[:required].tobytes()


def test_the_merged_tensor_is_its_own_memory():
    records = incremental_records([TURN_1, TURN_2])
    merged = assemble_incremental_r3(records, required_rows=11, num_layers=NUM_LAYERS)
    assert merged.flags.c_contiguous and merged.flags.writeable
    merged[:] = -1  # the records' payloads are untouched
    assert assemble_incremental_r3(records, 11, NUM_LAYERS).tobytes() == routing_rows(11).tobytes()


def test_a_stop_edge_row_on_the_last_patch_is_dropped():
    first = incremental_records([TURN_1])[0]
    edge = make_record(*TURN_2, start_len=6, routed=routing_rows(6, offset=6))  # rows [6, 12): one past the end
    merged = assemble_incremental_r3([first, edge], required_rows=11, num_layers=NUM_LAYERS)
    assert merged.tobytes() == routing_rows(11).tobytes()


def test_an_error_of_a_later_turn_comes_before_a_top_k_disagreement():
    first = incremental_records([TURN_1])[0]
    wider = make_record(*TURN_2, start_len=6)
    wider.meta_info["routed_experts"] = encode_routed_experts(np.zeros((5, NUM_LAYERS, 4), dtype=np.int32))
    gapped = make_record([*TURN_2[0], 10, 11, 12, 13], [14], start_len=13, routed=routing_rows(4, offset=13))
    with pytest.raises(ValueError, match=r"turn 2 starts at row 13 .* gap over rows \[11, 13\)"):
        assemble_incremental_r3([first, wider, gapped], required_rows=16, num_layers=NUM_LAYERS)


def test_too_few_rows_comes_before_a_top_k_disagreement():
    first = incremental_records([TURN_1])[0]
    wider = make_record(*TURN_2, start_len=6)
    wider.meta_info["routed_experts"] = encode_routed_experts(np.zeros((5, NUM_LAYERS, 4), dtype=np.int32))
    with pytest.raises(ValueError, match=r"cover rows \[0, 11\) but the sample needs 20"):
        assemble_incremental_r3([first, wider], required_rows=20, num_layers=NUM_LAYERS)


def test_a_negative_row_count_is_refused_by_name():
    with pytest.raises(ValueError, match="required_rows must be >= 0, got -1"):
        assemble_incremental_r3(incremental_records([TURN_1]), required_rows=-1, num_layers=NUM_LAYERS)
