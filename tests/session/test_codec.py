import numpy as np
import pytest
from safetensors.numpy import load, save

from miles_runner.session.codec import META_KEY, decode_samples, encode_samples
from miles_runner.session.samples import Sample, SampleStatus


def make_sample(**overrides) -> Sample:
    fields = dict(
        tokens=[1, 2, 3, 4],
        response_length=2,
        loss_mask=[1, 0],
        rollout_log_probs=[-0.25, 0.0],
        rollout_routed_experts=np.arange(12, dtype=np.int32).reshape(3, 2, 2),
        status=SampleStatus.COMPLETED,
        response="3 4",
        weight_versions=["v1"],
        prefix_cache_info={"cached_tokens": 1, "total_prompt_tokens": 2},
        metadata={"k": "v"},
    )
    return Sample(**{**fields, **overrides})


def assert_same(decoded: Sample, original: Sample) -> None:
    for name in ("tokens", "response_length", "loss_mask", "rollout_log_probs", "status", "response"):
        assert getattr(decoded, name) == getattr(original, name), name
    assert decoded.rollout_routed_experts.dtype == np.int32
    assert np.array_equal(decoded.rollout_routed_experts, original.rollout_routed_experts)


def test_round_trip_keeps_every_field():
    original = make_sample()
    reply = decode_samples(encode_samples([original], {"accumulated_token_ids": [1, 2, 3, 4]}))
    assert_same(reply.samples[0], original)
    assert reply.session_metadata == {"accumulated_token_ids": [1, 2, 3, 4]}
    assert reply.empty_reason is None


def test_several_samples_keep_their_order_and_reward():
    samples = [make_sample(tokens=[1, 2, 3, 4], reward=1.0), make_sample(tokens=[5, 6, 7, 8], reward=0.5)]
    reply = decode_samples(encode_samples(samples, {}, with_reward=True))
    assert [s.tokens for s in reply.samples] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [s.reward for s in reply.samples] == [1.0, 0.5]


def test_an_empty_reply_carries_its_reason():
    reply = decode_samples(encode_samples([], {"x": 1}, "no_records"))
    assert (reply.samples, reply.empty_reason) == ([], "no_records")


def test_a_missing_routing_tensor_is_null_and_a_zero_size_one_is_kept():
    none_r3 = decode_samples(encode_samples([make_sample(rollout_routed_experts=None)], {})).samples[0]
    empty = np.zeros((0, 2, 0), dtype=np.int32)
    zero_r3 = decode_samples(encode_samples([make_sample(rollout_routed_experts=empty)], {})).samples[0]
    assert none_r3.rollout_routed_experts is None
    assert zero_r3.rollout_routed_experts.shape == (0, 2, 0)


def test_non_contiguous_routing_round_trips():
    strided = np.arange(24, dtype=np.int32).reshape(3, 2, 4)[:, :, ::2]
    decoded = decode_samples(encode_samples([make_sample(rollout_routed_experts=strided)], {})).samples[0]
    assert np.array_equal(decoded.rollout_routed_experts, strided)


def test_routing_that_is_not_int32_is_rejected():
    with pytest.raises(ValueError, match="must be an int32 ndarray, got int64"):
        encode_samples([make_sample(rollout_routed_experts=np.zeros((3, 2, 2), dtype=np.int64))], {})


def test_a_negative_loss_mask_is_not_wrapped_into_uint8():
    with pytest.raises(ValueError, match="loss_mask cannot be written as uint8"):
        encode_samples([make_sample(loss_mask=[1, -1])], {})


def test_an_unreferenced_tensor_fails_decoding():
    tensors = load(encode_samples([make_sample()], {}))
    tensors["tokens.7"] = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match=r"no sample refers to: \['tokens.7'\]"):
        decode_samples(save(tensors))


def test_a_dtype_mismatch_fails_decoding():
    tensors = load(encode_samples([make_sample()], {}))
    tensors["tokens.0"] = tensors["tokens.0"].astype(np.int32)
    with pytest.raises(ValueError, match=r"tokens\.0 has dtype int32, expected int64"):
        decode_samples(save(tensors))


def test_bytes_that_are_not_safetensors_fail_decoding():
    with pytest.raises(ValueError, match="not a safetensors blob"):
        decode_samples(b"not a payload")


def test_a_payload_without_metadata_fails_decoding():
    tensors = load(encode_samples([make_sample()], {}))
    del tensors[META_KEY]
    with pytest.raises(ValueError, match="no _samples_meta"):
        decode_samples(save(tensors))
