"""Schemathesis against a real embedded engine, from its own OpenAPI schema: every
operation, positive and negative data, bounded examples: no 5xx, and every answer's status code, content type and
body as the schema documents them.

The engine runs keyed (the fuzzer sends the key, so requests get past the auth check), with LoRA on and a short
context (every generation ends within 64 tokens). Left out of the main pass: `/init_weights_update_group`, which
connects to whatever `master_address` a request names (this suite sends traffic to loopback only), and
`/pause_generation`, which by design holds every later generation until `/continue_generation`; those two are
fuzzed in a pass of their own, and the engine is resumed after it.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from miles_testkit.openapi_fuzz import assert_clean, fuzz_openapi
from tests.embedded_engine.server_process import EngineProcess, start_engine

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

KEY = "engine-fuzz-key"
KEY_ENV = "MILES_ENGINE_FUZZ_KEY"
MAX_EXAMPLES = 5
NEVER_FUZZED = ("POST /init_weights_update_group",)
AUTH = {"Authorization": f"Bearer {KEY}"}
PAUSE_PASS = ("POST /pause_generation", "POST /continue_generation")


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory, monkeypatch_module) -> Iterator[EngineProcess]:
    from miles_runner.models.tiny_model import ensure_tiny_model

    monkeypatch_module.setenv(KEY_ENV, KEY)
    process = start_engine(
        ensure_tiny_model("tiny-dense"),
        tmp_path_factory.mktemp("fuzz") / "engine.log",
        "--api-key-env",
        KEY_ENV,
        "--enable-lora",
        "--context-length",
        "64",
    )
    yield process
    process.stop()


def _operations(url: str) -> list[str]:
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()  # behind the key, as in SGLang
    return [f"{method.upper()} {path}" for path, ops in schema["paths"].items() for method in ops]


def test_engine_fuzz_finds_no_server_error_and_no_schema_violation(keyed_engine: EngineProcess, capsys) -> None:
    summary = fuzz_openapi(keyed_engine.url, token=KEY, max_examples=MAX_EXAMPLES, exclude=NEVER_FUZZED + PAUSE_PASS)
    others = [op for op in _operations(keyed_engine.url) if op not in PAUSE_PASS]
    try:
        paused = fuzz_openapi(keyed_engine.url, token=KEY, max_examples=MAX_EXAMPLES, exclude=others)
    finally:
        httpx.post(f"{keyed_engine.url}/continue_generation", json={}, headers=AUTH, timeout=30)

    with capsys.disabled():
        print(f"\nengine fuzz: {summary.counts()}; pause pass: {paused.counts()}")
    assert_clean(summary, min_requests=1000)
    assert_clean(paused, min_requests=20)
    assert set(summary.requests_per_operation) | set(paused.requests_per_operation) == set(
        _operations(keyed_engine.url)
    ) - set(NEVER_FUZZED)
    assert summary.statuses[200] > 0 and summary.statuses[401] == 0, summary.report()  # past the auth check
    assert httpx.get(f"{keyed_engine.url}/health", timeout=10).status_code == 200, keyed_engine.log_tail()
