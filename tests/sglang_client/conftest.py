"""Shared, session-scoped engines for the client contract and router tests (started once, always stopped)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.procs.ports import free_port
from miles_testkit.contract import build_contract_adapter, contract_engine_argv
from miles_testkit.contract.sglang_spec import SGLangSpec, SpecMissing, load_spec, pinned_wheel
from miles_testkit.launch import engine_url, start_engine
from miles_testkit.servers import RecordingProxy

from .engines import EMBEDDED, ENGINE_START_TIMEOUT_S, TEST_ENV

os.environ.update(TEST_ENV)


@pytest.fixture(scope="session")
def tiny_moe_dir() -> Path:
    return ensure_tiny_model("tiny-moe")


@pytest.fixture(scope="session")
def contract_adapter(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_contract_adapter(tiny_moe_dir, tmp_path_factory.mktemp("contract") / "adapter")


@pytest.fixture(scope="session")
def contract_engine_url(
    tiny_moe_dir: Path, contract_adapter: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The embedded engine with LoRA (the contract adapter loaded at start) and routed experts on."""
    port = free_port()
    argv = contract_engine_argv(EMBEDDED, tiny_moe_dir, port, contract_adapter)
    log_path = tmp_path_factory.mktemp("logs") / "contract_engine.log"
    engine = start_engine(argv, port=port, log_path=log_path, env=TEST_ENV, timeout_s=ENGINE_START_TIMEOUT_S)
    yield engine_url(argv, port)
    engine.stop()


@pytest.fixture(scope="session")
def sglang_spec() -> SGLangSpec:
    """The pinned SGLang's request definitions, read from the wheel `make sglang-spec` downloads (CI runs make
    test, which downloads it first: there a missing wheel fails; a bare pytest run skips with the command)."""
    try:
        return load_spec(pinned_wheel())
    except SpecMissing as missing:
        if os.environ.get("CI"):
            pytest.fail(str(missing))
        pytest.skip(str(missing))


@pytest.fixture
def recording_proxy(contract_engine_url: str) -> Iterator[RecordingProxy]:
    """The contract engine behind a recording proxy: point a client at `.url`, read what it sent in `.sent`."""
    with RecordingProxy(contract_engine_url) as proxy:
        yield proxy
