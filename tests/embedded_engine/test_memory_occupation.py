"""release/resume_memory_occupation as SGLang 0.5.23 serves them (memory_occupation.py): what is freed and given back,
what a request meets meanwhile, and what is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from safetensors import safe_open

from .server_process import EngineProcess, start_engine
from .test_pause_abort import until_running

pytestmark = pytest.mark.integration

PROBE = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}
LONG = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 1500, "temperature": 0.0, "ignore_eos": True}}
HELD_S = 1.0  # how long a request must stay unanswered to count as held


@pytest.fixture(scope="module")
def saver_engine(tiny_moe_dir: Path, adapter_dirs: dict[str, Path], tmp_path_factory) -> Iterator[EngineProcess]:
    """Memory saver on, no CPU backup (the weights come back from the model path), an adapter loaded."""
    log = tmp_path_factory.mktemp("saver") / "engine.log"
    adapter = f"attn_a={adapter_dirs['attn_a']}"
    process = start_engine(tiny_moe_dir, log, "--enable-memory-saver", "--enable-lora", "--lora-paths", adapter)
    yield process
    process.stop()


@pytest.fixture()
async def saver(saver_engine: EngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=saver_engine.url, timeout=60.0) as http:
        yield http
        for path in ("/continue_generation", "/resume_memory_occupation"):  # whatever a failed test left
            await http.post(path, json={})


async def occupation(client: httpx.AsyncClient) -> dict:
    return (await client.get("/server_info")).json()["internal_states"][0]["memory_occupation"]


async def logprobs(client: httpx.AsyncClient, **fields) -> list:
    response = await client.post("/generate", json={**PROBE, "return_logprob": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()["meta_info"]["output_token_logprobs"]


def weight_bytes(model_dir: Path) -> int:
    with safe_open(model_dir / "model.safetensors", "pt") as weights:
        return sum(weights.get_tensor(name).nbytes for name in weights.keys())  # noqa: SIM118 (not a dict)


async def test_release_frees_the_base_weights_and_resume_gives_the_same_logprobs(saver, tiny_moe_dir):
    before = await logprobs(saver, lora_path="attn_a")
    response = await saver.post("/release_memory_occupation", json={})
    assert response.status_code == 200 and response.json() is None  # SGLang's handler returns nothing
    released = await occupation(saver)
    assert released["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert released["freed_bytes"]["weights"] == weight_bytes(tiny_moe_dir)  # every base tensor, the adapter kept
    await saver.post("/resume_memory_occupation", json={"tags": ["weights"]})
    await saver.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]})
    assert (await occupation(saver))["released"] == []
    assert await logprobs(saver, lora_path="attn_a") == before  # reloaded from the model path, adapter intact


async def test_a_request_sent_while_released_waits_for_every_tag_and_then_runs(saver):
    await saver.post("/release_memory_occupation", json={"tags": ["kv_cache", "weights"]})
    held = asyncio.create_task(saver.post("/generate", json=PROBE))
    await asyncio.sleep(HELD_S)
    await saver.post("/resume_memory_occupation", json={"tags": ["weights"]})
    await asyncio.sleep(HELD_S)
    assert not held.done(), "a request ran while the KV cache was released"
    await saver.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    response = await asyncio.wait_for(held, 60)
    assert response.status_code == 200 and len(response.json()["output_ids"]) == 6


async def test_release_is_refused_while_a_request_runs_and_allowed_once_it_is_retracted(saver):
    running = asyncio.create_task(saver.post("/generate", json=LONG))
    await until_running(saver)
    refused = await saver.post("/release_memory_occupation", json={})
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == "release_memory_occupation should be called only when server is idle."
    await saver.post("/pause_generation", json={"mode": "retract"})  # miles' pause: the request waits, without KV
    assert (await saver.post("/release_memory_occupation", json={})).status_code == 200
    await saver.post("/resume_memory_occupation", json={})
    await saver.post("/continue_generation", json={})
    done = (await asyncio.wait_for(running, 120)).json()
    assert done["meta_info"]["finish_reason"]["type"] == "length"


async def test_a_base_weight_update_is_refused_while_the_weights_are_released(saver, tiny_moe_dir):
    await saver.post("/release_memory_occupation", json={"tags": ["weights"]})
    update = await saver.post("/update_weights_from_disk", json={"model_path": str(tiny_moe_dir)})
    assert update.status_code == 400 and "resume_memory_occupation" in update.json()["message"]
    await saver.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert (await saver.post("/update_weights_from_disk", json={"model_path": str(tiny_moe_dir)})).status_code == 200


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/resume_memory_occupation", {"tags": ["weights"]}, "['weights'] not released; released now: none"),
        ("/release_memory_occupation", {"tags": ["weight"]}, "unknown memory tag(s) ['weight']"),
        ("/release_memory_occupation", {"tags": "weights"}, "tags: "),
    ],
)
async def test_a_bad_tag_is_a_400_naming_it(saver, path, body, says):
    response = await saver.post(path, json=body)
    assert response.status_code == 400 and says in response.json()["error"]["message"]
    assert (await occupation(saver))["released"] == []


@pytest.fixture(scope="module")
def backup_engine(tiny_dense_dir: Path, tmp_path_factory) -> Iterator[EngineProcess]:
    log = tmp_path_factory.mktemp("backup") / "engine.log"
    process = start_engine(tiny_dense_dir, log, "--enable-memory-saver", "--enable-weights-cpu-backup")
    yield process
    process.stop()


async def test_with_a_cpu_backup_the_weights_stay_in_host_memory_and_come_back_from_it(backup_engine):
    async with httpx.AsyncClient(base_url=backup_engine.url, timeout=60.0) as client:
        before = await logprobs(client)
        await client.post("/release_memory_occupation", json={"tags": ["weights"]})
        assert (await occupation(client))["freed_bytes"] == {"weights": 0}  # the backup is their own memory
        await client.post("/resume_memory_occupation", json={"tags": ["weights"]})
        assert await logprobs(client) == before


async def test_without_the_memory_saver_nothing_is_freed_and_requests_run(plain_client):
    await plain_client.post("/release_memory_occupation", json={})
    try:
        state = await occupation(plain_client)
        assert state["released"] == ["cuda_graph", "kv_cache", "weights"] and not any(state["freed_bytes"].values())
        response = await asyncio.wait_for(plain_client.post("/generate", json=PROBE), 60)  # as SGLang: it runs
        assert response.status_code == 200
    finally:
        await plain_client.post("/resume_memory_occupation", json={})
