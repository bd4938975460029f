"""The base64 paths of tensors and routing: what the fast codecs send and read back is exactly what the
stdlib's would have, and a body built by splicing base64 parses to the body given."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from miles_runner.sglang_client.base64_json import dumps_with_base64
from miles_runner.sglang_client.routed_experts import decode_routed_experts, encode_routed_experts
from miles_runner.sglang_client.tensor_wire import (
    deserialize_named_tensors,
    lora_tensor_payloads,
    serialize_named_tensors,
)

FIELD = "serialized_named_tensors"


def test_routing_encodes_as_the_stdlib_base64_of_its_bytes():
    rows = np.random.default_rng(0).integers(0, 128, (7, 3, 8), dtype=np.int32)
    assert encode_routed_experts(rows) == base64.b64encode(rows.tobytes()).decode("ascii")


def test_routing_decodes_to_a_writable_int32_array():
    rows = np.random.default_rng(1).integers(0, 128, (5, 2, 4), dtype=np.int32)
    decoded = decode_routed_experts(encode_routed_experts(rows), 5, 2)
    assert decoded.dtype == np.int32 and decoded.flags.writeable and np.array_equal(decoded, rows)


def test_routing_with_line_breaks_decodes_as_the_stdlib_did():
    rows = np.arange(4 * 2 * 3, dtype=np.int32).reshape(4, 2, 3)
    text = base64.encodebytes(rows.tobytes()).decode("ascii")  # a line break every 76 characters
    assert "\n" in text
    assert np.array_equal(decode_routed_experts(text, 4, 2), rows)


def test_routing_that_is_not_base64_is_a_value_error():
    with pytest.raises(ValueError):
        decode_routed_experts("abc", 1, 2)


def test_tensors_round_trip_and_tied_ones_are_saved_apart():
    weight = torch.randn(4, 3)
    tensors = {"embed.weight": weight, "lm_head.weight": weight, "bias": torch.arange(3.0)}  # tied: one storage
    back = deserialize_named_tensors(serialize_named_tensors(tensors))
    assert set(back) == set(tensors) and all(torch.equal(back[name], tensors[name]) for name in tensors)


def test_tensors_payload_is_the_stdlib_base64_of_the_safetensors_blob():
    from safetensors.torch import load

    tensors = {"a": torch.randn(2, 5), "b": torch.randn(7).to(torch.bfloat16)}
    blob = base64.b64decode(serialize_named_tensors(tensors), validate=True)
    assert all(torch.equal(load(blob)[name], tensors[name]) for name in tensors)


def test_one_serialized_entry_per_tensor_parallel_rank():
    payloads = lora_tensor_payloads("embedded", {"a": torch.ones(3)}, tp_size=4)
    assert len(payloads) == 4 and len(set(payloads)) == 1
    assert torch.equal(deserialize_named_tensors(payloads[3])["a"], torch.ones(3))


def test_a_bad_tensor_payload_is_a_value_error():
    with pytest.raises(ValueError, match="not a base64 safetensors blob"):
        deserialize_named_tensors("not base64 !")


@pytest.mark.parametrize(
    "body",
    [
        {"lora_name": "a", "config_dict": {"r": 8, "target_modules": ["q_proj"]}, FIELD: ["QUJD", "REVGRw=="]},
        {FIELD: ["QUJD"]},
        {FIELD: []},
        {"lora_name": "é", FIELD: ["QUJD"], "pinned": True},
        {"lora_name": "x", FIELD: ['QU"JD\\', "not base64 !\n"]},  # not base64: JSON-escaped as usual
        {FIELD: "QUJD"},  # not a list: left to the engine to refuse
    ],
)
def test_a_spliced_body_parses_to_the_body_given(body):
    assert json.loads(dumps_with_base64(body, FIELD)) == body


def test_a_spliced_body_refuses_what_json_refuses():
    with pytest.raises(ValueError):
        dumps_with_base64({"config_dict": {"alpha": float("nan")}, FIELD: ["QUJD"]}, FIELD)
