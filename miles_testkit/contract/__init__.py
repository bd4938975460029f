"""The EngineClient contract: every client call run against a live engine, with the protocol facts it checks.

One list of checks serves both targets: the pytest contract tests run it against the embedded engine, and
`scripts/gpu_check_sglang.py` against real SGLang serving the same tiny model folder. Each check is
independent and leaves the engine as it found it (adapters, weights, weight version, pause state), so checks
can run alone or in any order. The engine must be started with LoRA on, `target.adapter_name` loaded from
`target.adapter_path`, and `--enable-return-routed-experts`.

Modules:
    base          ContractTarget, ContractViolation, the CONTRACT_CHECKS registry and run_contract
    engine_setup  the contract adapter and the engine launch command
    helpers       expect, request ids and payloads, expected errors, background streams
    info          checks: health, model and server info, model cards
    generate      checks: native /generate (batches, n samples, streams, routed experts)
    lora          checks: LoRA serving, loading and unloading
    weights       checks: weight updates, weight version, flush_cache, release/resume of memory occupation
    abort_pause   checks: aborts and the three pause modes
    chat          checks: the OpenAI chat endpoint
    errors        checks: malformed requests
    sglang_spec   the pinned SGLang's request definitions, read from its wheel (routes, fields, shapes)
    wire_check    a sent request body checked against them (what SGLang refuses, and what it would drop)
"""

# Imported for their @contract_check registrations. Import order is the order of CONTRACT_CHECKS, which is the
# order run_contract runs and reports them in: sorting these imports would reorder every summary.
# isort: off
from miles_testkit.contract import info, generate, lora, weights, abort_pause, chat, errors  # noqa: F401

# isort: on
from miles_testkit.contract.base import (
    CONTRACT_CHECKS,
    Check,
    ContractTarget,
    ContractViolation,
    TensorWire,
    contract_check,
    run_contract,
)
from miles_testkit.contract.engine_setup import CONTRACT_ADAPTER, build_contract_adapter, contract_engine_argv
from miles_testkit.contract.helpers import generate_payload, rid
from miles_testkit.contract.info import health_endpoints_answer_ok
from miles_testkit.contract.weights import flush_cache_succeeds_when_idle

__all__ = [
    "CONTRACT_ADAPTER",
    "CONTRACT_CHECKS",
    "Check",
    "ContractTarget",
    "ContractViolation",
    "TensorWire",
    "build_contract_adapter",
    "contract_check",
    "contract_engine_argv",
    "flush_cache_succeeds_when_idle",
    "generate_payload",
    "health_endpoints_answer_ok",
    "rid",
    "run_contract",
]
