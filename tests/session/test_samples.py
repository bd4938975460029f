import numpy as np
import pytest
from session_records import NUM_LAYERS, incremental_records, make_record, routing_rows

from miles_runner.session.samples import (
    AssemblyOptions,
    SampleStatus,
    build_sample,
    compute_turn_samples,
    merge_samples,
    truncate_samples_by_total_tokens,
)

TURN_1 = ([1, 2, 3, 4], [5, 6, 7])
TURN_2 = ([1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11, 12])
ACCUMULATED = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
FULL = AssemblyOptions(max_trim_tokens=0, use_addition_r3=False, num_layers=NUM_LAYERS)
ADDITION = AssemblyOptions(max_trim_tokens=0, use_addition_r3=True, num_layers=NUM_LAYERS)


def decode(ids):
    return " ".join(map(str, ids))


def full_r3_records():
    return [
        make_record(*TURN_1, routed=routing_rows(6)),
        make_record(*TURN_2, routed=routing_rows(11)),
    ]


def test_one_turn_sample_holds_prompt_completion_and_logprobs():
    [sample] = compute_turn_samples([make_record(*TURN_1)], [1, 2, 3, 4, 5, 6, 7], FULL)
    assert sample.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert sample.response_length == 3
    assert sample.loss_mask == [1, 1, 1]
    assert sample.rollout_log_probs == pytest.approx([-0.5, -0.6, -0.7])
    assert sample.status is SampleStatus.COMPLETED


def test_merge_masks_observation_tokens_between_turns():
    sample, reason = build_sample([make_record(*TURN_1), make_record(*TURN_2)], ACCUMULATED, FULL, decode)
    assert reason is None
    assert sample.tokens == ACCUMULATED
    assert sample.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert sample.rollout_log_probs[3:5] == [0.0, 0.0]
    assert sample.response == decode(ACCUMULATED[4:])
    assert sample.weight_versions == ["default", "default"]


def test_a_trailing_token_left_out_of_the_next_prompt_is_trimmed_within_the_allowance():
    # The first completion ended with token 99, which the next prompt does not contain.
    records = [make_record([1, 2, 3, 4], [5, 6, 7, 99]), make_record(*TURN_2)]
    options = AssemblyOptions(max_trim_tokens=1, use_addition_r3=False, num_layers=NUM_LAYERS)
    samples = compute_turn_samples(records, ACCUMULATED, options)
    assert samples[0].tokens == [1, 2, 3, 4, 5, 6, 7]


def test_trimming_beyond_the_allowance_is_rejected():
    records = [make_record([1, 2, 3, 4], [5, 6, 7, 99]), make_record(*TURN_2)]
    with pytest.raises(ValueError, match="turn 0: 1 output tokens are not in the session ids"):
        compute_turn_samples(records, ACCUMULATED, FULL)


def test_the_last_turn_may_not_be_trimmed():
    options = AssemblyOptions(max_trim_tokens=3, use_addition_r3=False, num_layers=NUM_LAYERS)
    with pytest.raises(ValueError, match="turn 0"):
        compute_turn_samples([make_record(*TURN_1)], [1, 2, 3, 4, 5], options)


def test_a_prompt_that_is_not_a_prefix_of_the_session_is_rejected():
    with pytest.raises(ValueError, match="turn 1: its prompt"):
        compute_turn_samples([make_record(*TURN_1), make_record([1, 2, 9], [10])], ACCUMULATED, FULL)


def test_records_that_do_not_reach_the_end_of_the_session_are_rejected():
    with pytest.raises(ValueError, match="cover 7 tokens but the session holds 12"):
        compute_turn_samples([make_record(*TURN_1)], ACCUMULATED, FULL)


def test_truncation_cuts_the_first_overflowing_turn_and_drops_the_rest():
    turns = compute_turn_samples([make_record(*TURN_1), make_record(*TURN_2)], ACCUMULATED, FULL)
    kept = truncate_samples_by_total_tokens(turns, max_seq_len=6)
    assert len(kept) == 1
    assert kept[0].tokens == [1, 2, 3, 4, 5, 6]
    assert kept[0].response_length == 2
    assert kept[0].status is SampleStatus.TRUNCATED


def test_truncation_drops_a_turn_with_no_output_left():
    turns = compute_turn_samples([make_record(*TURN_1), make_record(*TURN_2)], ACCUMULATED, FULL)
    kept = truncate_samples_by_total_tokens(turns, max_seq_len=9)
    assert [len(sample.tokens) for sample in kept] == [7]


def test_merge_stops_after_a_truncated_turn():
    records = [make_record(*TURN_1, finish_reason="length"), make_record(*TURN_2)]
    turns = compute_turn_samples(records, ACCUMULATED, FULL)
    merged = merge_samples(turns, decode)
    assert merged.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert merged.status is SampleStatus.TRUNCATED


def test_full_r3_comes_from_the_last_turn_cut_to_tokens_minus_one():
    sample, _ = build_sample(full_r3_records(), ACCUMULATED, FULL, decode)
    assert sample.rollout_routed_experts.shape == (11, NUM_LAYERS, 2)
    assert sample.rollout_routed_experts.tobytes() == routing_rows(11).tobytes()


def test_merge_stops_at_a_replay_gap():
    records = [make_record(*TURN_1, routed=routing_rows(6)), make_record(*TURN_2)]
    sample, _ = build_sample(records, ACCUMULATED, FULL, decode)
    assert sample.tokens == [1, 2, 3, 4, 5, 6, 7]


def test_incremental_r3_equals_the_full_r3_sample():
    full, _ = build_sample(full_r3_records(), ACCUMULATED, FULL, decode)
    incremental, _ = build_sample(incremental_records([TURN_1, TURN_2]), ACCUMULATED, ADDITION, decode)
    assert incremental.rollout_routed_experts.tobytes() == full.rollout_routed_experts.tobytes()
    assert incremental.tokens == full.tokens


def test_incremental_r3_follows_truncation():
    options = AssemblyOptions(max_trim_tokens=0, use_addition_r3=True, num_layers=NUM_LAYERS, max_seq_len=10)
    sample, _ = build_sample(incremental_records([TURN_1, TURN_2]), ACCUMULATED, options, decode)
    assert len(sample.tokens) == 10
    assert np.array_equal(sample.rollout_routed_experts, routing_rows(9))


def test_replay_off_leaves_no_routing():
    sample, _ = build_sample([make_record(*TURN_1)], [1, 2, 3, 4, 5, 6, 7], ADDITION, decode)
    assert sample.rollout_routed_experts is None


def test_no_records_is_an_empty_reply():
    assert build_sample([], [], FULL, decode) == (None, "no_records")


def test_everything_truncated_is_an_empty_reply():
    options = AssemblyOptions(max_trim_tokens=0, use_addition_r3=False, num_layers=NUM_LAYERS, max_seq_len=3)
    assert build_sample([make_record(*TURN_1)], [1, 2, 3, 4, 5, 6, 7], options, decode) == (
        None,
        "all_truncated",
    )
