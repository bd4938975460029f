"""The contract's machinery: what a check gets (ContractTarget), how a check registers (`contract_check`
into CONTRACT_CHECKS), how a failed fact is raised (ContractViolation), and `run_contract`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.core.sglang_protocol import MILES_FORK
from miles_runner.sglang_client.client import EngineClient

PROMPT = "What is 3 plus 4?"
CHECK_TIMEOUT_S = 180.0

TensorWire = Callable[[Mapping[str, Any]], str]


class ContractViolation(AssertionError):
    """The engine's answer breaks the SGLang protocol as the client relies on it."""


@dataclass(frozen=True)
class ContractTarget:
    """A live engine and what the checks need to know about it.

    `lora_wire` turns an adapter's `{name: tensor}` and `weights_wire` base weights into one entry of
    `serialized_named_tensors` (MultiprocessingSerializer strings for real SGLang, base64 safetensors for the
    embedded engine: sglang_client/tensor_wire.py). `long_tokens` is a generation length that is still running a
    moment after its first token arrives. `logprob_tol` is how far two runs of the same request may differ
    (float32 on CPU is near exact; an engine in bf16 needs more). `build` is the SGLang build the engine serves
    as (core.sglang_protocol): the checks of fork-only features expect the fork's behaviour, or stock's.
    """

    client: EngineClient
    model_dir: Path
    adapter_name: str
    adapter_path: Path
    lora_wire: TensorWire
    weights_wire: TensorWire
    long_tokens: int = 512
    logprob_tol: float = 1e-3
    build: str = MILES_FORK

    def same_logprobs(self, a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) and all(abs(x - y) <= self.logprob_tol for x, y in zip(a, b, strict=True))

    @property
    def model_config(self) -> dict[str, Any]:
        return json.loads((self.model_dir / "config.json").read_text())

    @property
    def num_layers(self) -> int:
        return int(self.model_config["num_hidden_layers"])

    @property
    def num_experts(self) -> int:
        config = self.model_config  # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts
        return int(config.get("num_experts", config.get("num_local_experts")))

    @property
    def top_k(self) -> int:
        return int(self.model_config["num_experts_per_tok"])


Check = Callable[[ContractTarget], Awaitable[dict[str, Any]]]
CONTRACT_CHECKS: list[Check] = []


def contract_check(check: Check) -> Check:
    CONTRACT_CHECKS.append(check)
    return check


async def run_contract(target: ContractTarget, checks: list[Check] | None = None) -> dict[str, Any]:
    """Run the checks in order; a failing check is recorded and the rest still run."""
    results: dict[str, Any] = {}
    for check in checks or CONTRACT_CHECKS:
        started = time.monotonic()
        try:
            facts = await asyncio.wait_for(check(target), CHECK_TIMEOUT_S)
            results[check.__name__] = {"ok": True, "facts": facts}
        except Exception as exc:  # the summary reports every failure, whatever its kind
            results[check.__name__] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[check.__name__]["seconds"] = round(time.monotonic() - started, 3)
    passed = sum(result["ok"] for result in results.values())
    return {"passed": passed, "failed": len(results) - passed, "checks": results}
