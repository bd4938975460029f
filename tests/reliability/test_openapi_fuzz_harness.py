"""The schemathesis harness (miles_testkit/openapi_fuzz.py) finds what it must: a tiny FastAPI app on loopback with
two named faults, a route that answers 500 on one input and one whose answer breaks its documented schema, is
reported with both; the same app without the faults is reported clean. So a server's "0 server errors, 0 schema
violations" in the reliability suite means the harness looked, not that it was blind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from miles_testkit.openapi_fuzz import assert_clean, fuzz_openapi
from miles_testkit.servers import ThreadedServer

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

TOKEN = "fuzz-harness-token"
ERROR = {"type": "object", "properties": {"detail": {}}, "required": ["detail"]}
# Starlette answers 400 to a body it cannot parse and FastAPI 422 to one that breaks the model; both documented.
ERRORS = {
    400: {"description": "Unparsable body", "content": {"application/json": {"schema": ERROR}}},
    401: {"description": "Missing or wrong bearer token", "content": {"application/json": {"schema": ERROR}}},
}


class Item(BaseModel):
    name: str
    count: int


class Total(BaseModel):
    total: int


class Count(BaseModel):
    n: int


def make_app(*, faulty: bool) -> FastAPI:
    """Two routes behind a bearer token; `faulty` injects the named faults: `/add` raises on an empty name (a 500)
    and `/count/{x}` answers a string where its schema says integer (a schema violation)."""
    app = FastAPI(responses=ERRORS)

    @app.middleware("http")
    async def require_token(request: Request, call_next):  # type: ignore[no-untyped-def]
        if request.url.path != "/openapi.json" and request.headers.get("authorization") != f"Bearer {TOKEN}":
            return JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401)
        return await call_next(request)

    @app.post("/add", response_model=Total)
    def add(item: Item) -> Total:
        if faulty and item.name == "":
            raise RuntimeError("injected fault: empty name")
        if item.name == "":
            raise HTTPException(400, "name: must not be empty")
        return Total(total=item.count)

    @app.get("/count/{x}", response_model=Count)
    def count(x: int) -> JSONResponse:
        return JSONResponse({"n": "not a number" if faulty else x})

    return app


@pytest.fixture(scope="module")
def faulty_url() -> Iterator[str]:
    server = ThreadedServer(make_app(faulty=True)).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def correct_url() -> Iterator[str]:
    server = ThreadedServer(make_app(faulty=False)).start()
    yield server.url
    server.stop()


def test_the_harness_reports_an_injected_500_and_an_injected_schema_violation(faulty_url: str) -> None:
    summary = fuzz_openapi(faulty_url, token=TOKEN, max_examples=10)

    assert summary.server_errors > 0, summary.report()
    crashes = [f for f in summary.failures_of("POST /add") if f.is_server_error]
    assert crashes and all(f.status == 500 for f in crashes), summary.report()
    assert all('"name": ""' in f.curl for f in crashes), summary.report()  # each replays the input that fails
    violations = {f.check for f in summary.failures_of("GET /count/{x}")}
    assert "response_schema_conformance" in violations, summary.report()
    assert {f.operation for f in summary.schema_violations} >= {"GET /count/{x}"}
    with pytest.raises(AssertionError, match="schema violations"):
        assert_clean(summary)


def test_the_harness_reports_a_correct_app_clean_and_sends_the_token(correct_url: str) -> None:
    summary = fuzz_openapi(correct_url, token=TOKEN, max_examples=10)

    assert_clean(summary, min_requests=20)
    assert set(summary.requests_per_operation) == {"POST /add", "GET /count/{x}"}
    # Without the token every answer would be a documented 401, clean but testing nothing past the auth check.
    assert summary.statuses[200] > 0, summary.report()


def test_the_harness_is_deterministic_and_leaves_out_excluded_operations(correct_url: str) -> None:
    first = fuzz_openapi(correct_url, token=TOKEN, max_examples=5, exclude=("POST /add",))
    second = fuzz_openapi(correct_url, token=TOKEN, max_examples=5, exclude=("POST /add",))

    assert set(first.requests_per_operation) == {"GET /count/{x}"}
    assert first.requests_per_operation == second.requests_per_operation
