"""R3: the wire format, and the real per-token top-k expert ids the engine returns."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from miles_runner.sglang_client.routed_experts import decode_routed_experts, encode_routed_experts

pytestmark = pytest.mark.integration

PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11]
LAYERS, TOPK, EXPERTS = 2, 2, 8


def test_encode_decode_round_trips():
    arr = np.arange(5 * 3 * 2, dtype=np.int32).reshape(5, 3, 2)
    assert np.array_equal(decode_routed_experts(encode_routed_experts(arr), 5, 3), arr)


def test_encode_is_base64_of_little_endian_int32_bytes():
    arr = np.array([[[1, 258]]], dtype=np.int32)
    assert base64.b64decode(encode_routed_experts(arr)) == b"\x01\x00\x00\x00\x02\x01\x00\x00"


def test_decode_drops_one_stop_edge_row():
    arr = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    assert np.array_equal(decode_routed_experts(encode_routed_experts(arr), 3, 2), arr[:3])


def test_decode_of_no_tokens_is_empty():
    assert decode_routed_experts("", 0, 4).shape == (0, 4, 0)


def test_decode_rejects_a_row_count_that_does_not_fit():
    arr = np.zeros((5, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match="num_tokens"):
        decode_routed_experts(encode_routed_experts(arr), 3, 2)


def test_decode_rejects_a_partial_int32():
    with pytest.raises(ValueError, match="whole number of int32"):
        decode_routed_experts(base64.b64encode(b"\x01\x02\x03").decode(), 1, 1)


def test_encode_rejects_non_int32():
    with pytest.raises(ValueError, match="int32"):
        encode_routed_experts(np.zeros((1, 1, 1), dtype=np.int64))


async def _generate(client, **body) -> dict:
    base = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
    response = await client.post("/generate", json={**base, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_routed_experts_cover_every_forwarded_token(client):
    out = await _generate(client, return_routed_experts=True)
    meta = out["meta_info"]
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1
    routing = decode_routed_experts(meta["routed_experts"], rows, LAYERS)
    assert routing.shape == (rows, LAYERS, TOPK)
    assert routing.min() >= 0 and routing.max() < EXPERTS
    assert all(len(set(row)) == TOPK for row in routing.reshape(-1, TOPK).tolist())


async def test_routed_experts_are_the_models_router_choices(client, tiny_moe_dir):
    import torch
    from transformers import AutoModelForCausalLM

    out = await _generate(client, return_routed_experts=True)
    tokens = PROMPT_IDS + out["output_ids"]
    routing = decode_routed_experts(out["meta_info"]["routed_experts"], len(tokens) - 1, LAYERS)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    captured = {}
    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda _m, _i, o, index=index: captured.__setitem__(index, o[2]))
    with torch.no_grad():
        model(torch.tensor([tokens[:-1]]))
    expected = np.stack([captured[i].numpy() for i in range(LAYERS)], axis=1)
    assert np.array_equal(routing, expected)


async def test_routed_experts_start_len_returns_the_tail_rows(client):
    full = await _generate(client, return_routed_experts=True)
    start = 4
    tail = await _generate(client, return_routed_experts=True, routed_experts_start_len=start)
    rows = len(PROMPT_IDS) + len(full["output_ids"]) - 1
    full_rows = decode_routed_experts(full["meta_info"]["routed_experts"], rows, LAYERS)
    tail_rows = decode_routed_experts(tail["meta_info"]["routed_experts"], rows - start, LAYERS)
    assert np.array_equal(tail_rows, full_rows[start:])


async def test_routed_experts_are_absent_unless_requested(client):
    out = await _generate(client)
    assert "routed_experts" not in out["meta_info"]


async def test_routed_experts_are_absent_without_the_server_flag(plain_client):
    out = await _generate(plain_client, return_routed_experts=True)
    assert "routed_experts" not in out["meta_info"]


async def test_chat_puts_routed_experts_in_sglext(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0.0}
    out = (await client.post("/v1/chat/completions", json={**body, "return_routed_experts": True})).json()
    rows = out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"] - 1
    assert decode_routed_experts(out["sglext"]["routed_experts"], rows, LAYERS).shape == (rows, LAYERS, TOPK)
    with_meta = (
        await client.post(
            "/v1/chat/completions", json={**body, "return_routed_experts": True, "return_meta_info": True}
        )
    ).json()
    assert "sglext" not in with_meta
    assert with_meta["choices"][0]["meta_info"]["routed_experts"] == out["sglext"]["routed_experts"]
