"""LoRA: load/unload (from disk and from tensors), per-request adapters, several adapters in one batch."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_runner.embedded_engine.lora_registry import serialize_lora_tensors

from .conftest import MAX_LORA_RANK

pytestmark = pytest.mark.integration

PROMPT_IDS = [5, 6, 7, 8, 9, 10]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0}


async def generate(client, **body) -> dict | list:
    response = await client.post("/generate", json={"input_ids": PROMPT_IDS, "sampling_params": GREEDY, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def load(client, name: str, path) -> dict:
    response = await client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    assert response.status_code == 200, response.text
    return response.json()


async def unload(client, name: str) -> None:
    response = await client.post("/unload_lora_adapter", json={"lora_name": name})
    assert response.status_code == 200, response.text


async def logprobs(client, adapter: str | None) -> list[float]:
    out = await generate(client, lora_path=adapter, return_logprob=True)
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


async def test_startup_adapter_is_listed_as_a_model_card(client, engine, adapter_dirs):
    cards = (await client.get("/v1/models")).json()["data"]
    adapter_card = next(c for c in cards if c["id"] == "attn_a")
    assert adapter_card["root"] == str(adapter_dirs["attn_a"])
    assert adapter_card["parent"] == cards[0]["id"]


async def test_an_adapter_changes_the_output(client):
    assert await logprobs(client, "attn_a") != await logprobs(client, None)


async def test_load_reply_lists_loaded_adapters_and_unload_removes_it(client, adapter_dirs):
    reply = await load(client, "attn_b_tmp", adapter_dirs["attn_b"])
    assert reply["success"] is True and reply["error_message"] is None
    assert reply["loaded_adapters"]["attn_b_tmp"] == str(adapter_dirs["attn_b"])
    await unload(client, "attn_b_tmp")
    response = await client.post("/generate", json={"input_ids": PROMPT_IDS, "lora_path": "attn_b_tmp"})
    assert response.status_code == 400


async def test_several_adapters_in_one_batch_match_their_single_requests(client, adapter_dirs):
    await load(client, "attn_b", adapter_dirs["attn_b"])
    try:
        adapters = [None, "attn_a", "attn_b", "attn_a"]
        batch = await generate(client, input_ids=[PROMPT_IDS] * 4, lora_path=adapters, return_logprob=True)
        for item, adapter in zip(batch, adapters, strict=True):
            alone = [t[0] for t in item["meta_info"]["output_token_logprobs"]]
            assert alone == pytest.approx(await logprobs(client, adapter), abs=1e-4)
    finally:
        await unload(client, "attn_b")


async def test_expert_adapter_applies_and_runs_beside_other_adapters(client, adapter_dirs):
    await load(client, "experts", adapter_dirs["experts"])
    try:
        base, expert = await logprobs(client, None), await logprobs(client, "experts")
        assert expert != base
        mixed = await asyncio.gather(*(logprobs(client, a) for a in [None, "experts", "attn_a"]))
        assert mixed[0] == pytest.approx(base, abs=1e-4) and mixed[1] == pytest.approx(expert, abs=1e-4)
    finally:
        await unload(client, "experts")


async def test_load_from_tensors_equals_load_from_disk(client, adapter_dirs):
    from safetensors.torch import load_file

    folder = adapter_dirs["attn_b"]
    body = {
        "lora_name": "attn_b_tensors",
        "config_dict": json.loads((folder / "adapter_config.json").read_text()),
        "serialized_named_tensors": [serialize_lora_tensors(load_file(folder / "adapter_model.safetensors"))],
    }
    response = await client.post("/load_lora_adapter_from_tensors", json=body)
    assert response.status_code == 200, response.text
    await load(client, "attn_b_disk", folder)
    try:
        assert await logprobs(client, "attn_b_tensors") == pytest.approx(
            await logprobs(client, "attn_b_disk"), abs=1e-5
        )
    finally:
        await unload(client, "attn_b_tensors")
        await unload(client, "attn_b_disk")


async def test_chat_model_suffix_selects_the_adapter(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0.0, "logprobs": True}
    by_suffix = (await client.post("/v1/chat/completions", json={**body, "model": "base:attn_a"})).json()
    by_field = (await client.post("/v1/chat/completions", json={**body, "lora_path": "attn_a"})).json()
    base = (await client.post("/v1/chat/completions", json=body)).json()

    def lps(out):
        return [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]

    assert lps(by_suffix) == pytest.approx(lps(by_field), abs=1e-5)
    assert lps(by_suffix) != lps(base)


async def test_unknown_adapter_gets_sglangs_400(client):
    response = await client.post("/generate", json={"input_ids": PROMPT_IDS, "lora_path": "nope"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("The following requested LoRA adapters are not loaded: nope\nLoaded adapters:")


async def test_unknown_adapter_on_chat_gets_an_openai_400(client):
    body = {"messages": [{"role": "user", "content": "hi"}], "model": "base:nope"}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["object"] == "error" and "not loaded: nope" in response.json()["message"]


async def test_loading_a_name_twice_is_400_already_exists(client, adapter_dirs):
    response = await client.post(
        "/load_lora_adapter", json={"lora_name": "attn_a", "lora_path": str(adapter_dirs["attn_a"])}
    )
    assert response.status_code == 400
    assert response.json()["success"] is False
    assert response.json()["error_message"].startswith("LoRA with name attn_a already exists.")


async def test_unloading_an_unknown_name_is_400(client):
    response = await client.post("/unload_lora_adapter", json={"lora_name": "never_loaded"})
    assert response.status_code == 400
    assert "does not exist" in response.json()["error_message"]


async def test_adapter_above_max_lora_rank_is_refused(client, adapter_dirs):
    response = await client.post(
        "/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapter_dirs["too_big"])}
    )
    assert response.status_code == 400
    assert f"--max-lora-rank {MAX_LORA_RANK}" in response.json()["error_message"]


async def test_adapter_on_an_engine_without_lora_is_400(plain_client):
    response = await plain_client.post("/generate", json={"input_ids": PROMPT_IDS, "lora_path": "attn_a"})
    assert response.status_code == 400
    assert "LoRA is not enabled" in response.json()["error"]["message"]
