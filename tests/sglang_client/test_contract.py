"""The EngineClient contract (miles_testkit/contract/) against the embedded engine: one test per
protocol behaviour. scripts/gpu_check_sglang.py runs the same checks against real SGLang."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from miles_runner.sglang_client.client import EngineClient, EngineUnavailable
from miles_runner.sglang_client.tensor_wire import serialize_lora_tensors, serialize_named_tensors
from miles_testkit.contract import (
    CONTRACT_ADAPTER,
    CONTRACT_CHECKS,
    Check,
    ContractTarget,
    ContractViolation,
    flush_cache_succeeds_when_idle,
    generate_payload,
    health_endpoints_answer_ok,
    rid,
    run_contract,
)

pytestmark = pytest.mark.integration

# Long enough to still be running well after its first token on CPU, short enough to finish after a pause.
EMBEDDED_LONG_TOKENS = 128


@pytest.fixture
async def contract_target(
    contract_engine_url: str, tiny_moe_dir: Path, contract_adapter: Path
) -> AsyncIterator[ContractTarget]:
    async with EngineClient(contract_engine_url, timeout_s=120) as client:
        yield ContractTarget(
            client,
            tiny_moe_dir,
            CONTRACT_ADAPTER,
            contract_adapter,
            lora_wire=serialize_lora_tensors,
            weights_wire=serialize_named_tensors,
            long_tokens=EMBEDDED_LONG_TOKENS,
        )


@pytest.mark.parametrize("check", CONTRACT_CHECKS, ids=lambda check: check.__name__)
async def test_engine_contract(check: Check, contract_target: ContractTarget) -> None:
    await check(contract_target)


async def test_per_call_timeout_raises_engine_unavailable(contract_target: ContractTarget) -> None:
    request_id = rid("timeout")
    client = contract_target.client
    try:
        with pytest.raises(EngineUnavailable, match="timed out"):
            await client.generate(generate_payload(contract_target.long_tokens, rid=request_id), timeout_s=0.1)
    finally:
        await client.abort_request(request_id)


async def test_run_contract_records_failures_and_keeps_going(contract_target: ContractTarget) -> None:
    async def fake_failing_check(target: ContractTarget) -> dict:
        raise ContractViolation("injected failure")

    checks = [health_endpoints_answer_ok, fake_failing_check, flush_cache_succeeds_when_idle]
    summary = await run_contract(contract_target, checks)
    assert (summary["passed"], summary["failed"]) == (2, 1)
    assert summary["checks"]["fake_failing_check"]["error"] == "ContractViolation: injected failure"
    assert summary["checks"]["flush_cache_succeeds_when_idle"]["ok"] is True
