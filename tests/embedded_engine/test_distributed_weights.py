"""Weight-update groups: the engine joins a gloo group with this test process as the trainer (rank 0) and
receives base weights and LoRA adapters by broadcast, with the metadata over HTTP."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.sglang_client.tensor_wire import serialize_lora_tensors, serialize_named_tensors
from miles_runner.sglang_client.weight_update_group import (
    broadcast_tensors,
    destroy_weight_update_group,
    dtype_name,
    init_weight_update_group,
)

from .server_process import EngineProcess, start_engine

pytestmark = pytest.mark.integration

DIST_TIMEOUT_S = 3
GROUP = "test_group"
PROMPT = {"input_ids": [5, 6, 7, 8, 9, 10], "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}


@pytest.fixture(scope="module")
def dist_engine(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    """An engine with LoRA and a short --dist-timeout, so a broadcast that never comes fails in seconds."""
    log = tmp_path_factory.mktemp("dist_engine") / "engine.log"
    process = start_engine(
        tiny_moe_dir, log, "--enable-lora", "--max-lora-rank", "8", "--dist-timeout", str(DIST_TIMEOUT_S)
    )
    yield process
    process.stop()


@pytest.fixture()
async def http(dist_engine: EngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=dist_engine.url, timeout=60.0) as client:
        yield client


@pytest.fixture()
async def group(http: httpx.AsyncClient) -> AsyncIterator[object]:
    """A group of two: this process (rank 0) and the engine (rank 1); left on both sides afterwards."""
    port = free_port()
    init_body = {
        "master_address": LOOPBACK,
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": GROUP,
        "backend": "gloo",
    }
    here = asyncio.to_thread(
        init_weight_update_group,
        backend="gloo",
        master_address=LOOPBACK,
        master_port=port,
        rank=0,
        world_size=2,
        group_name=GROUP,
        timeout_s=DIST_TIMEOUT_S,
    )
    process_group, reply = await asyncio.gather(here, http.post("/init_weights_update_group", json=init_body))
    assert reply.status_code == 200, reply.text
    yield process_group
    destroy_weight_update_group(process_group)
    await http.post("/destroy_weights_update_group", json={"group_name": GROUP})


def metadata(tensors: dict[str, torch.Tensor]) -> dict:
    return {
        "names": list(tensors),
        "dtypes": [dtype_name(t.dtype) for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "group_name": GROUP,
    }


async def post_and_broadcast(http, path: str, body: dict, tensors: dict[str, torch.Tensor], process_group):
    payload = [t.contiguous() for t in tensors.values()]
    reply, _ = await asyncio.gather(
        http.post(path, json=body), asyncio.to_thread(broadcast_tensors, payload, process_group)
    )
    return reply


def adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((folder / "adapter_config.json").read_text()), load_file(folder / "adapter_model.safetensors")


async def logprobs(http, adapter_name: str | None = None) -> list[float]:
    reply = await http.post("/generate", json={**PROMPT, "lora_path": adapter_name, "return_logprob": True})
    assert reply.status_code == 200, reply.text
    return [t[0] for t in reply.json()["meta_info"]["output_token_logprobs"]]


async def load_lora_by_broadcast(http, process_group, name: str, folder: Path, *, upsert: bool = False, scale=1.0):
    config, tensors = adapter(folder)
    tensors = {k: v * scale for k, v in tensors.items()}
    body = {"lora_name": name, "config_dict": config, "upsert": upsert, **metadata(tensors)}
    return await post_and_broadcast(http, "/load_lora_adapter_from_distributed", body, tensors, process_group)


async def unload(http, name: str) -> None:
    assert (await http.post("/unload_lora_adapter", json={"lora_name": name})).status_code == 200


async def test_adapter_received_by_broadcast_equals_the_same_adapter_from_disk(http, group, adapter_dirs):
    reply = await load_lora_by_broadcast(http, group, "attn_b_dist", adapter_dirs["attn_b"])
    assert reply.status_code == 200, reply.text
    assert reply.json()["loaded_adapters"]["attn_b_dist"] == "__tensor__"
    disk = {"lora_name": "attn_b_disk", "lora_path": str(adapter_dirs["attn_b"])}
    assert (await http.post("/load_lora_adapter", json=disk)).status_code == 200
    try:
        assert await logprobs(http, "attn_b_dist") == pytest.approx(await logprobs(http, "attn_b_disk"), abs=1e-5)
        assert await logprobs(http, "attn_b_dist") != await logprobs(http, None)
    finally:
        await unload(http, "attn_b_dist")
        await unload(http, "attn_b_disk")


async def test_upsert_replaces_a_loaded_adapters_weights_in_place(http, group, adapter_dirs):
    assert (await load_lora_by_broadcast(http, group, "slot", adapter_dirs["attn_b"])).status_code == 200
    try:
        before = await logprobs(http, "slot")
        reply = await load_lora_by_broadcast(http, group, "slot", adapter_dirs["attn_b"], upsert=True, scale=2.0)
        assert reply.status_code == 200, reply.text
        assert list(reply.json()["loaded_adapters"]) == ["slot"]
        config, tensors = adapter(adapter_dirs["attn_b"])
        doubled_tensors = serialize_lora_tensors({k: v * 2 for k, v in tensors.items()})
        doubled = {"lora_name": "doubled", "config_dict": config, "serialized_named_tensors": [doubled_tensors]}
        assert (await http.post("/load_lora_adapter_from_tensors", json=doubled)).status_code == 200
        after = await logprobs(http, "slot")
        assert after != pytest.approx(before, abs=1e-5)
        assert after == pytest.approx(await logprobs(http, "doubled"), abs=1e-5)
        await unload(http, "doubled")
    finally:
        await unload(http, "slot")


async def test_a_reload_by_broadcast_after_an_unload_serves_the_new_weights(http, group, adapter_dirs):
    """The sync's unload-then-load: the second receive lands in the unloaded adapter's weights (parked_weights)."""
    base = await logprobs(http)
    assert (await load_lora_by_broadcast(http, group, "again", adapter_dirs["attn_b"])).status_code == 200
    adapted = await logprobs(http, "again")
    assert adapted != pytest.approx(base, abs=1e-5)
    for scale, expected in ((0.0, base), (1.0, adapted)):
        await unload(http, "again")
        reply = await load_lora_by_broadcast(http, group, "again", adapter_dirs["attn_b"], scale=scale)
        assert reply.status_code == 200, reply.text
        assert await logprobs(http, "again") == pytest.approx(expected, abs=1e-5)
    await unload(http, "again")


async def test_upsert_with_other_shapes_is_400_and_keeps_the_adapter(http, group, adapter_dirs):
    assert (await load_lora_by_broadcast(http, group, "slot2", adapter_dirs["attn_b"])).status_code == 200
    try:
        before = await logprobs(http, "slot2")
        reply = await load_lora_by_broadcast(http, group, "slot2", adapter_dirs["attn_a"], upsert=True)
        assert reply.status_code == 400
        assert "in-place update" in reply.json()["error_message"]
        assert await logprobs(http, "slot2") == pytest.approx(before, abs=1e-6)
    finally:
        await unload(http, "slot2")


async def test_loading_a_loaded_name_without_upsert_is_400_already_exists(http, group, adapter_dirs):
    disk = {"lora_name": "taken", "lora_path": str(adapter_dirs["attn_b"])}
    assert (await http.post("/load_lora_adapter", json=disk)).status_code == 200
    try:
        config, tensors = adapter(adapter_dirs["attn_b"])
        body = {"lora_name": "taken", "config_dict": config, **metadata(tensors)}
        reply = await http.post("/load_lora_adapter_from_distributed", json=body)  # refused before any receive
        assert reply.status_code == 400
        assert reply.json()["error_message"].startswith("LoRA with name taken already exists.")
    finally:
        await unload(http, "taken")


async def test_base_weights_by_broadcast_change_the_output_and_set_the_version(http, group, tiny_moe_dir):
    original = load_file(tiny_moe_dir / "model.safetensors")["lm_head.weight"]
    before = await logprobs(http)
    changed = {"lm_head.weight": original * 2}
    body = {**metadata(changed), "weight_version": "dist-1"}
    reply = await post_and_broadcast(http, "/update_weights_from_distributed", body, changed, group)
    assert reply.status_code == 200 and reply.json()["success"] is True, reply.text
    try:
        assert await logprobs(http) != pytest.approx(before, abs=1e-5)
        assert (await http.get("/model_info")).json()["weight_version"] == "dist-1"
    finally:
        restore = {"serialized_named_tensors": [serialize_named_tensors({"lm_head.weight": original})]}
        assert (await http.post("/update_weights_from_tensor", json=restore)).status_code == 200
    assert await logprobs(http) == pytest.approx(before, abs=1e-6)


async def test_an_unknown_base_weight_is_400_after_the_receive_and_the_group_stays_usable(http, group):
    unknown = {"no.such.weight": torch.zeros(3)}
    reply = await post_and_broadcast(http, "/update_weights_from_distributed", metadata(unknown), unknown, group)
    assert reply.status_code == 400 and "unknown parameter" in reply.json()["message"]
    again = await post_and_broadcast(http, "/update_weights_from_distributed", metadata(unknown), unknown, group)
    assert again.status_code == 400 and "unknown parameter" in again.json()["message"]


@pytest.mark.parametrize(
    "path",
    ["/update_weights_from_distributed", "/load_lora_adapter_from_distributed", "/destroy_weights_update_group"],
)
async def test_a_group_that_is_not_initialised_is_400(http, path):
    body = {
        "lora_name": "x",
        "config_dict": {"r": 4},
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[2]],
        "group_name": "never_made",
    }
    reply = await http.post(path, json=body)
    assert reply.status_code == 400
    assert "'never_made' is not initialized" in reply.text


@pytest.mark.parametrize(
    "field, value",
    [("names", ["a", "b"]), ("dtypes", []), ("shapes", [[2], [3]])],
)
async def test_metadata_lists_of_different_lengths_are_400(http, field, value):
    body = {"names": ["a"], "dtypes": ["float32"], "shapes": [[2]], "group_name": GROUP, field: value}
    reply = await http.post("/update_weights_from_distributed", json=body)
    assert reply.status_code == 400
    assert "one entry per tensor" in reply.json()["error"]["message"]


async def test_an_unknown_dtype_is_400(http):
    body = {"names": ["a"], "dtypes": ["float99"], "shapes": [[2]], "group_name": GROUP}
    reply = await http.post("/update_weights_from_distributed", json=body)
    assert reply.status_code == 400 and "unknown dtype 'float99'" in reply.json()["message"]


async def test_a_broadcast_that_never_comes_is_400_after_the_timeout_and_drops_the_group(http, group):
    tensors = {"lm_head.weight": torch.zeros(4)}
    started = time.monotonic()
    reply = await http.post("/update_weights_from_distributed", json=metadata(tensors))
    assert reply.status_code == 400 and "the group is destroyed" in reply.json()["message"]
    assert time.monotonic() - started < DIST_TIMEOUT_S + 10
    gone = await http.post("/destroy_weights_update_group", json={"group_name": GROUP})
    assert gone.status_code == 400
    assert (await http.post("/generate", json=PROMPT)).status_code == 200


async def test_init_without_the_trainer_is_400_after_the_timeout(http):
    body = {
        "master_address": LOOPBACK,
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "lonely",
        "backend": "gloo",
    }
    started = time.monotonic()
    reply = await http.post("/init_weights_update_group", json=body)
    assert reply.status_code == 400 and "Failed to init weight update group 'lonely'" in reply.json()["message"]
    assert time.monotonic() - started < DIST_TIMEOUT_S + 10


async def test_initialising_a_group_twice_is_400(http, group):
    body = {
        "master_address": LOOPBACK,
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": GROUP,
        "backend": "gloo",
    }
    reply = await http.post("/init_weights_update_group", json=body)
    assert reply.status_code == 400 and "already initialized" in reply.json()["message"]


@pytest.mark.parametrize(
    "change, message",
    [({"backend": "nccl"}, "use 'gloo'"), ({"rank_offset": 2}, "outside the group"), ({"world_size": 1}, "world_size")],
)
async def test_an_impossible_group_is_400(http, change, message):
    body = {
        "master_address": LOOPBACK,
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "impossible",
        "backend": "gloo",
        **change,
    }
    reply = await http.post("/init_weights_update_group", json=body)
    assert reply.status_code == 400 and message in reply.text


async def test_adapter_tensors_that_do_not_fit_the_config_are_400(http, group, adapter_dirs):
    config, _ = adapter(adapter_dirs["attn_b"])  # rank 8 on q_proj
    _, tensors = adapter(adapter_dirs["too_big"])  # rank 16 on q_proj
    body = {"lora_name": "misfit", "config_dict": config, **metadata(tensors)}
    reply = await post_and_broadcast(http, "/load_lora_adapter_from_distributed", body, tensors, group)
    assert reply.status_code == 400 and "do not match the config" in reply.json()["error_message"]
    assert "misfit" not in reply.json()["loaded_adapters"]
