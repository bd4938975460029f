"""LoRA serving: `lora_path` applies an adapter, unknown adapters are errors, adapters load and unload from
disk or tensors.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from miles_testkit.contract.base import ContractTarget, contract_check
from miles_testkit.contract.helpers import expect, expect_engine_error, generate_payload, greedy_logprobs


@contract_check
async def lora_path_applies_the_adapter(target: ContractTarget) -> dict[str, Any]:
    _, base = await greedy_logprobs(target.client)
    _, adapted = await greedy_logprobs(target.client, lora_path=target.adapter_name)
    expect(not target.same_logprobs(base, adapted), "the adapter does not change the logprobs")
    return {}


@contract_check
async def unknown_adapter_is_a_400_naming_it(target: ContractTarget) -> dict[str, Any]:
    name = f"never_loaded_{uuid.uuid4().hex[:8]}"
    error = await expect_engine_error(target.client.generate(generate_payload(4, lora_path=name)))
    expect(name in error.message, f"the message does not name the adapter: {error.message}")
    return {"message": error.message}


@contract_check
async def stream_with_unknown_adapter_raises_engine_error(target: ContractTarget) -> dict[str, Any]:
    # SGLang reports it as a 400 before the stream or as an error event inside it; both are an EngineError.
    name = f"never_loaded_{uuid.uuid4().hex[:8]}"
    stream = target.client.generate_stream(generate_payload(4, lora_path=name))
    error = await expect_engine_error(anext(stream))
    return {"message": error.message}


@contract_check
async def lora_load_and_unload_round_trip(target: ContractTarget) -> dict[str, Any]:
    name = f"contract_{uuid.uuid4().hex[:8]}"
    loaded = await target.client.load_lora_adapter(name, str(target.adapter_path))
    try:
        expect(loaded["success"] is True and name in loaded["loaded_adapters"], f"load reply {loaded}")
        await expect_engine_error(target.client.load_lora_adapter(name, str(target.adapter_path)))
        _, via_new = await greedy_logprobs(target.client, lora_path=name)
        _, via_startup = await greedy_logprobs(target.client, lora_path=target.adapter_name)
        expect(target.same_logprobs(via_new, via_startup), "the same adapter loaded twice gives different logprobs")
    finally:
        unloaded = await target.client.unload_lora_adapter(name)
    expect(unloaded["success"] is True and name not in unloaded["loaded_adapters"], f"unload {unloaded}")
    return {}


@contract_check
async def lora_load_from_tensors_matches_disk_adapter(target: ContractTarget) -> dict[str, Any]:
    # Imported here: safetensors.torch loads torch, which importing the contract should not.
    from safetensors.torch import load_file

    tensors = load_file(str(target.adapter_path / "adapter_model.safetensors"))
    config = json.loads((target.adapter_path / "adapter_config.json").read_text())
    name = f"contract_tensors_{uuid.uuid4().hex[:8]}"
    loaded = await target.client.load_lora_adapter_from_tensors(name, config, [target.lora_wire(tensors)])  # TP 1
    try:
        expect(loaded["success"] is True, f"load_lora_adapter_from_tensors reply {loaded}")
        _, from_tensors = await greedy_logprobs(target.client, lora_path=name)
        _, from_disk = await greedy_logprobs(target.client, lora_path=target.adapter_name)
        expect(
            target.same_logprobs(from_tensors, from_disk), "adapter from tensors differs from the same adapter on disk"
        )
    finally:
        await target.client.unload_lora_adapter(name)
    return {}
