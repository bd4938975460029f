"""The servers' FastAPI constructor: native telemetry off where FastAPI has it (0.165+), plain FastAPI before."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from miles_runner.sglang_client import fastapi_app as module
from miles_runner.sglang_client.fastapi_app import TELEMETRY_OFF, fastapi_app


class FastAPIWithoutTelemetry(FastAPI):
    """FastAPI's constructor as it was before 0.165 (pyproject allows >= 0.115): no `telemetry` option."""

    def __init__(self, *, title: str = "FastAPI", **kwargs) -> None:
        if "telemetry" in kwargs:
            raise TypeError("FastAPI.__init__() got an unexpected keyword argument 'telemetry'")
        super().__init__(title=title, **kwargs)


@pytest.fixture
def older_fastapi(monkeypatch):
    monkeypatch.setattr(module, "FastAPI", FastAPIWithoutTelemetry)
    module.has_telemetry_option.cache_clear()
    yield
    module.has_telemetry_option.cache_clear()


def test_the_servers_app_has_native_telemetry_switched_off():
    if not module.has_telemetry_option():
        pytest.skip("this FastAPI has no native telemetry")
    app = fastapi_app(title="t")
    assert {key: app._telemetry[key] for key in TELEMETRY_OFF} == TELEMETRY_OFF
    assert not app._native_telemetry.enabled()


def test_a_caller_given_telemetry_config_wins():
    if not module.has_telemetry_option():
        pytest.skip("this FastAPI has no native telemetry")
    assert fastapi_app(telemetry={"tracing": True})._telemetry["tracing"] is True


def test_an_older_fastapi_without_the_option_builds_a_working_app(older_fastapi):
    app = fastapi_app(title="old")
    assert isinstance(app, FastAPIWithoutTelemetry) and app.title == "old"

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    assert TestClient(app).get("/health").json() == {"status": "ok"}
