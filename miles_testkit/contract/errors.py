"""Malformed requests: the native and the OpenAI endpoints answer with errors in their own formats."""

from __future__ import annotations

from typing import Any

from miles_testkit.contract.base import ContractTarget, contract_check
from miles_testkit.contract.helpers import expect, expect_engine_error, greedy


@contract_check
async def generate_without_input_is_a_native_error(target: ContractTarget) -> dict[str, Any]:
    error = await expect_engine_error(target.client.generate({"sampling_params": greedy(4)}), (400, 422))
    return {"status": error.status_code, "message": error.message}


@contract_check
async def chat_without_messages_is_an_openai_error(target: ContractTarget) -> dict[str, Any]:
    error = await expect_engine_error(target.client.chat_completions({"model": "default"}), (400, 422))
    expect("messages" in error.message, f"the message does not name the field: {error.message}")
    return {"status": error.status_code}
