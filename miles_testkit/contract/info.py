"""Health and info endpoints: /health, model and server info, and the model cards of the base and adapter."""

from __future__ import annotations

from typing import Any

from miles_testkit.contract.base import ContractTarget, contract_check
from miles_testkit.contract.helpers import expect


@contract_check
async def health_endpoints_answer_ok(target: ContractTarget) -> dict[str, Any]:
    expect(await target.client.health(), "/health is not 200")
    expect(await target.client.health_generate(), "/health_generate is not 200")
    return {}


@contract_check
async def model_info_reports_weight_version(target: ContractTarget) -> dict[str, Any]:
    info = await target.client.model_info()
    expect(isinstance(info.get("weight_version"), str), f"no weight_version in {info}")
    expect("model_path" in info, f"no model_path in {info}")
    legacy = await target.client.request("GET", "/get_model_info")
    expect(legacy.status_code == 200, f"/get_model_info answered {legacy.status_code}")
    return {"weight_version": info["weight_version"]}


@contract_check
async def server_info_reports_lora_and_routed_experts(target: ContractTarget) -> dict[str, Any]:
    info = await target.client.server_info()
    expect(info.get("enable_lora") is True, "server_info.enable_lora is not true")
    expect(info.get("enable_return_routed_experts") is True, "enable_return_routed_experts is not true")
    legacy = await target.client.request("GET", "/get_server_info")
    expect(legacy.status_code == 200, f"/get_server_info answered {legacy.status_code}")
    return {"max_loras_per_batch": info.get("max_loras_per_batch")}


@contract_check
async def list_models_has_base_and_adapter_cards(target: ContractTarget) -> dict[str, Any]:
    ids = [card["id"] for card in await target.client.list_models()]
    expect(len(ids) >= 2, f"expected a base card and an adapter card, got {ids}")
    expect(target.adapter_name in ids[1:], f"adapter {target.adapter_name} has no card in {ids}")
    return {"models": ids}
