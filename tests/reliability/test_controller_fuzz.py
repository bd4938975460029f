"""Schemathesis against the multi-LoRA controller: the real service module, keyed, on loopback, its
engine a stand-in that takes aborts. Every route's answers must match the controller's own OpenAPI schema: 0 server
errors, 0 schema violations, and requests that get past the key check (200s), not only 401s."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_testkit.openapi_fuzz import assert_clean, fuzz_openapi
from miles_testkit.servers import ThreadedServer

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

KEY_ENV = "MILES_FUZZ_CONTROLLER_KEY"
KEY = "controller-fuzz-key"
MAX_EXAMPLES = 25  # per operation and mode: the run stays within seconds


def abort_taker() -> FastAPI:
    """A stand-in engine that answers every abort (the controller's only call to an engine)."""
    app = FastAPI()

    @app.post("/abort_request")
    async def abort_request() -> dict[str, str]:
        return {}

    return app


@pytest.fixture(scope="module")
def controller_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("controller")
    (folder / "adapters").mkdir()
    (folder / "adapters" / "math.yaml").write_text("task: reverse\nrank: 4\n")
    engine = ThreadedServer(abort_taker()).start()
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "miles_runner.multi_lora.http_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-slots",
        "4",
        "--max-lora-rank",
        "8",
        "--target-modules",
        "q_proj",
        "v_proj",
        "--engine-urls",
        engine.url,
        "--save-root",
        str(folder),
        "--adapters-dir",
        str(folder / "adapters"),
        "--api-key-env",
        KEY_ENV,
    ]
    url = f"http://127.0.0.1:{port}"
    process = ManagedProcess(
        "controller",
        argv,
        env={KEY_ENV: KEY},
        log_path=Path(folder) / "controller.log",
        health_url=f"{url}/health",
        startup_timeout_s=60,
    )
    with process:
        yield url
    engine.stop()


def test_the_controller_answers_every_fuzzed_request_as_its_schema_says(controller_url: str) -> None:
    summary = fuzz_openapi(controller_url, token=KEY, max_examples=MAX_EXAMPLES)
    print(summary.counts())  # the closing note's figures (pytest -s shows them)
    assert_clean(summary, min_requests=200)
    assert len(summary.requests_per_operation) == 15, summary.report()  # every route, /health included
    assert summary.statuses[200] > 0 and summary.statuses[400] > 0, summary.report()  # past the key check
