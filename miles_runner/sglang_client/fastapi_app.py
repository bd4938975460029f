"""One FastAPI constructor for the project's servers (engine, session server, multi-LoRA controller).

FastAPI 0.165 added native OpenTelemetry: every request asks the global tracer, meter and logger providers
whether telemetry is configured before it runs (CPU on every request, for nothing here). These servers
never export telemetry, so it is switched off where the installed FastAPI has the option (older versions,
which pyproject allows, have neither the option nor the per-request check).
"""

from __future__ import annotations

import inspect
import json
from functools import cache
from typing import Any

from fastapi import FastAPI

TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False}


@cache
def has_telemetry_option() -> bool:
    return "telemetry" in inspect.signature(FastAPI.__init__).parameters


def drop_validation_422(document: dict[str, Any]) -> dict[str, Any]:
    """`document` (an OpenAPI dict) without the 422 HTTPValidationError FastAPI lists on every route with
    parameters, for servers that never answer it (they map validation failures to 400, or parse bodies by hand)."""
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if "HTTPValidationError" in json.dumps(operation.get("responses", {}).get("422", {})):
                del operation["responses"]["422"]
    for name in ("HTTPValidationError", "ValidationError"):
        document.get("components", {}).get("schemas", {}).pop(name, None)
    return document


def fastapi_app(**kwargs: Any) -> FastAPI:
    """`FastAPI(**kwargs)` with native telemetry off when this FastAPI has it."""
    if has_telemetry_option():
        kwargs.setdefault("telemetry", TELEMETRY_OFF)
    return FastAPI(**kwargs)
