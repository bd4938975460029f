"""Weight updates from disk and from tensors, the reported weight version, flush_cache, and the release and resume
of memory occupation."""

from __future__ import annotations

import uuid
from typing import Any

from safetensors import safe_open

from miles_runner.core.sglang_protocol import WEIGHTS_TAG, offload_tags
from miles_runner.sglang_client import response as res
from miles_testkit.contract.base import ContractTarget, contract_check
from miles_testkit.contract.helpers import expect, generate_payload, greedy_logprobs


@contract_check
async def update_weights_from_disk_sets_weight_version(target: ContractTarget) -> dict[str, Any]:
    original = await target.client.weight_version()
    _, before = await greedy_logprobs(target.client)
    version = f"contract-disk-{uuid.uuid4().hex[:6]}"
    try:
        reply = await target.client.update_weights_from_disk(str(target.model_dir), weight_version=version)
        expect(reply["success"] is True, f"update reply {reply}")
        expect(await target.client.weight_version() == version, "model_info.weight_version not updated")
        result = await target.client.generate(generate_payload(8))
        expect(res.weight_version(result) == version, "meta_info.weight_version not updated")
        expect(
            target.same_logprobs(res.output_token_logprobs(result)[1], before),
            "reloading the same weights changed them",
        )
    finally:
        await target.client.update_weight_version(original)
    return {}


@contract_check
async def update_weights_from_tensor_changes_the_model(target: ContractTarget) -> dict[str, Any]:
    with safe_open(str(target.model_dir / "model.safetensors"), "pt") as weights:
        norm = weights.get_tensor("model.norm.weight")
    original = await target.client.weight_version()
    _, before = await greedy_logprobs(target.client)
    try:
        reply = await target.client.update_weights_from_tensor(
            [target.weights_wire({"model.norm.weight": norm * 3.0})], weight_version="contract-tensor"
        )
        expect(reply["success"] is True, f"update reply {reply}")
        _, scaled = await greedy_logprobs(target.client)
        expect(not target.same_logprobs(scaled, before), "scaling model.norm.weight did not change the logprobs")
        expect(await target.client.weight_version() == "contract-tensor", "weight_version not updated")
    finally:
        await target.client.update_weights_from_tensor([target.weights_wire({"model.norm.weight": norm})])
        await target.client.update_weight_version(original)
    _, restored = await greedy_logprobs(target.client)
    expect(target.same_logprobs(restored, before), "restoring model.norm.weight did not restore the logprobs")
    return {}


@contract_check
async def update_weight_version_is_reported(target: ContractTarget) -> dict[str, Any]:
    original = await target.client.weight_version()
    try:
        reply = await target.client.update_weight_version("contract-version")
        expect(reply["success"] is True, f"update_weight_version reply {reply}")
        expect(await target.client.weight_version() == "contract-version", "model_info not updated")
    finally:
        await target.client.update_weight_version(original)
    return {}


@contract_check
async def flush_cache_succeeds_when_idle(target: ContractTarget) -> dict[str, Any]:
    expect(await target.client.flush_cache() is True, "flush_cache on an idle engine did not succeed")
    return {}


@contract_check
async def release_and_resume_memory_occupation_keep_the_model(target: ContractTarget) -> dict[str, Any]:
    """miles' colocated cycle on an idle engine (docs/system.md §7): release the rollout's memory, take the weights
    back, then the rest; the engine answers as before, its adapter included."""
    _, before = await greedy_logprobs(target.client, lora_path=target.adapter_name)
    tags = offload_tags(["kv_cache", "weight"])
    await target.client.release_memory_occupation(tags)
    pending = list(tags)
    try:
        await target.client.resume_memory_occupation([WEIGHTS_TAG])
        pending.remove(WEIGHTS_TAG)
        await target.client.resume_memory_occupation(pending)
        pending = []
    finally:
        if pending:  # leave the engine whole for the next check
            await target.client.resume_memory_occupation(pending)
    _, after = await greedy_logprobs(target.client, lora_path=target.adapter_name)
    expect(target.same_logprobs(after, before), "the model answers differently after a release and resume")
    return {"tags": tags}
