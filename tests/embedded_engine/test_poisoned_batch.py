"""One bad request never fails the requests running beside it.

Two layers: bad sampling values are refused at admission (a 400 naming the field, the request never reaches the
batch), and a request that fails inside a batched step anyway (here: an adapter whose weights are NaN, so its
sampling distribution is NaN) fails alone, with SGLang's 500, while its batch neighbours finish normally.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

LONG_TOKENS = 200
LONG = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}}
IDS = [5, 6, 7]

POISONS = {
    "tiny_temperature_is_greedy": ({"temperature": 1e-300, "max_new_tokens": 4}, {}, None),
    "nan_temperature": ({"temperature": float("nan")}, {}, "temperature"),
    "infinite_temperature": ({"temperature": float("inf")}, {}, "temperature"),
    "nan_top_p": ({"top_p": float("nan")}, {}, "top_p"),
    "nan_min_p": ({"min_p": float("nan")}, {}, "min_p"),
    "out_of_vocab_stop_id_with_min_new_tokens": (
        {"stop_token_ids": [10**7], "min_new_tokens": 2},
        {},
        "stop_token_ids",
    ),
    "negative_stop_id": ({"stop_token_ids": [-3], "min_new_tokens": 2}, {}, "stop_token_ids"),
    "out_of_range_token_ids_logprob": ({}, {"return_logprob": True, "token_ids_logprob": [10**7]}, "token_ids_logprob"),
    "negative_top_logprobs_num": ({}, {"return_logprob": True, "top_logprobs_num": -2}, "top_logprobs_num"),
    "penalty_out_of_range": ({"repetition_penalty": 0.0}, {}, "repetition_penalty"),
}


async def _beside_a_long_generation(client, body: dict):
    """Send ``body`` while a long generation runs; return (its answer, the long generation's answer)."""
    long = asyncio.create_task(client.post("/generate", json=LONG))
    await asyncio.sleep(0.3)  # the long request is decoding
    try:
        # json.dumps writes NaN and Infinity as Python's json (and many clients) do; httpx's json= refuses them.
        answer = await client.post("/generate", content=json.dumps(body), headers={"content-type": "application/json"})
    finally:
        neighbour = await long
    return answer, neighbour


def _finished_normally(neighbour) -> None:
    assert neighbour.status_code == 200, neighbour.text
    item = neighbour.json()
    assert item["meta_info"]["finish_reason"]["type"] == "length"
    assert len(item["output_ids"]) == LONG_TOKENS


@pytest.mark.parametrize("case", POISONS, ids=list(POISONS))
async def test_a_poisoned_request_is_refused_and_its_neighbour_finishes(client, case):
    sampling, extra, field = POISONS[case]
    answer, neighbour = await _beside_a_long_generation(
        client, {"input_ids": IDS, "sampling_params": sampling, **extra}
    )
    _finished_normally(neighbour)
    if field is None:  # SGLang: a temperature below 1e-6 means greedy
        assert answer.status_code == 200, answer.text
    else:
        assert answer.status_code == 400, answer.text
        assert field in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def nan_adapter(adapter_dirs: dict[str, Path], tmp_path_factory) -> Path:
    """A real peft adapter folder whose weights are all NaN: it passes every admission check and fails at sampling."""
    import torch
    from safetensors.torch import load_file, save_file

    source = adapter_dirs["attn_b"]
    target = tmp_path_factory.mktemp("nan_adapter")
    shutil.copy(source / "adapter_config.json", target / "adapter_config.json")
    tensors = load_file(source / "adapter_model.safetensors")
    save_file(
        {name: torch.full_like(t, float("nan")) for name, t in tensors.items()}, target / "adapter_model.safetensors"
    )
    return target


async def test_a_request_failing_inside_the_batch_fails_alone(client, nan_adapter):
    loaded = await client.post("/load_lora_adapter", json={"lora_name": "nan_weights", "lora_path": str(nan_adapter)})
    assert loaded.status_code == 200, loaded.text
    try:
        body = {"input_ids": IDS, "lora_path": "nan_weights", "sampling_params": {"max_new_tokens": 4}}
        answer, neighbour = await _beside_a_long_generation(client, body)
        _finished_normally(neighbour)
        assert answer.status_code == 500, answer.text
        assert "Internal error during generation" in answer.json()["error"]["message"]
        # The engine goes on serving.
        assert (
            await client.post("/generate", json={"input_ids": IDS, "sampling_params": {"max_new_tokens": 2}})
        ).status_code == 200
    finally:
        await client.post("/unload_lora_adapter", json={"lora_name": "nan_weights"})
