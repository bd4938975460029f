"""Weight updates from disk and from tensors, and weight_version reporting."""

from __future__ import annotations

import pytest

from miles_runner.sglang_client.tensor_wire import serialize_named_tensors

PROMPT = {
    "input_ids": [5, 6, 7, 8],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0.0},
    "return_logprob": True,
}


async def _logprobs(client) -> list[float]:
    out = (await client.post("/generate", json=PROMPT)).json()
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


async def _version(client) -> str:
    return (await client.get("/model_info")).json()["weight_version"]


async def test_update_weights_from_disk_swaps_weights_and_sets_the_version(plain_client, plain_engine, tmp_path):
    from miles_runner.models.tiny_model import build_tiny_model

    original_path = (await plain_client.get("/model_info")).json()["model_path"]
    before = await _logprobs(plain_client)
    other = build_tiny_model(tmp_path / "other", dense=True, seed=5)
    reply = await plain_client.post(
        "/update_weights_from_disk", json={"model_path": str(other), "weight_version": "v2"}
    )
    assert reply.status_code == 200 and reply.json()["success"] is True
    try:
        assert await _logprobs(plain_client) != before
        assert await _version(plain_client) == "v2"
        out = (await plain_client.post("/generate", json=PROMPT)).json()
        assert out["meta_info"]["weight_version"] == "v2"
    finally:
        restore = {"model_path": original_path, "weight_version": "restored"}
        assert (await plain_client.post("/update_weights_from_disk", json=restore)).status_code == 200
    assert await _logprobs(plain_client) == pytest.approx(before, abs=1e-6)


async def test_update_weights_from_tensor_changes_named_parameters(plain_client, tiny_dense_dir):
    import torch
    from safetensors.torch import load_file

    original = load_file(tiny_dense_dir / "model.safetensors")["lm_head.weight"]
    before = await _logprobs(plain_client)
    body = {
        "serialized_named_tensors": [serialize_named_tensors({"lm_head.weight": original * 2})],
        "weight_version": "t1",
    }
    reply = await plain_client.post("/update_weights_from_tensor", json=body)
    assert reply.status_code == 200, reply.text
    try:
        assert await _logprobs(plain_client) != before
        assert await _version(plain_client) == "t1"
    finally:
        restore = {"serialized_named_tensors": [serialize_named_tensors({"lm_head.weight": original.clone()})]}
        assert (await plain_client.post("/update_weights_from_tensor", json=restore)).status_code == 200
    assert await _logprobs(plain_client) == pytest.approx(before, abs=1e-6)
    assert torch.equal(original, load_file(tiny_dense_dir / "model.safetensors")["lm_head.weight"])


async def test_update_weights_with_an_unknown_parameter_is_400(plain_client):
    body = {"serialized_named_tensors": [serialize_named_tensors({"no.such.weight": __import__("torch").zeros(2)})]}
    reply = await plain_client.post("/update_weights_from_tensor", json=body)
    assert reply.status_code == 400 and "unknown parameter" in reply.json()["message"]


async def test_update_weight_version_is_reported_everywhere(plain_client):
    reply = await plain_client.post("/update_weight_version", json={"new_version": "step-9"})
    assert reply.json() == {"success": True, "message": "Weight version updated to step-9", "new_version": "step-9"}
    assert await _version(plain_client) == "step-9"
    assert (await plain_client.get("/server_info")).json()["weight_version"] == "step-9"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await plain_client.post("/v1/chat/completions", json=chat)).json()["metadata"]["weight_version"] == "step-9"
