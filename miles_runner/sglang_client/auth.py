"""SGLang's HTTP auth levels (sglang/srt/utils/auth.py), for servers that speak SGLang's protocol.

- ``/health*``, ``/ready*``, ``/metrics*`` and ``OPTIONS`` are always open (probes carry no secrets);
- ``ADMIN_OPTIONAL`` routes (weights, adapters, pause, abort, cache ...) need the admin key when one is set,
  else the API key, else nothing;
- ``NORMAL`` routes need the API key when one is set (the admin key alone leaves them open, as in SGLang).

A refusal is SGLang's: 401 ``{"error": "Unauthorized"}``. Keys are compared in constant time. A route's level is
set with :func:`admin_optional` on its endpoint; the middleware finds it by matching the request to a route.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

NORMAL = "normal"
ADMIN_OPTIONAL = "admin_optional"
OPEN_PREFIXES = ("/health", "/ready", "/metrics")
UNAUTHORIZED = {"error": "Unauthorized"}

Endpoint = Callable[..., Any]


def admin_optional(endpoint: Endpoint) -> Endpoint:
    """Mark a route as SGLang's ADMIN_OPTIONAL (apply it below the route decorator, as SGLang does)."""
    endpoint._auth_level = ADMIN_OPTIONAL  # type: ignore[attr-defined]
    return endpoint


def bearer_matches(authorization: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <key>`` (scheme case-insensitive, constant time)."""
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def allowed(
    *, method: str, path: str, authorization: str | None, level: str, api_key: str | None, admin_api_key: str | None
) -> bool:
    """SGLang's ``decide_request_auth`` for the NORMAL and ADMIN_OPTIONAL levels."""
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if level == ADMIN_OPTIONAL and admin_api_key:
        return bearer_matches(authorization, admin_api_key)
    if api_key:
        return bearer_matches(authorization, api_key)
    return True


def install_auth(app: FastAPI, *, api_key: str | None, admin_api_key: str | None) -> None:
    """Refuse unauthorised requests before they reach a route (pure ASGI: client disconnects still propagate)."""
    if api_key or admin_api_key:
        app.add_middleware(_AuthMiddleware, api_key=api_key, admin_api_key=admin_api_key, routes_of=app)


def route_level(app: FastAPI, scope: Scope) -> str:
    for route in app.router.routes:
        match, child = route.matches(scope)
        if match == Match.FULL:
            endpoint = child.get("endpoint") or getattr(route, "endpoint", None)
            return getattr(endpoint, "_auth_level", NORMAL)
    return NORMAL


class _AuthMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_api_key: str | None, routes_of: FastAPI):
        self.app = app
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.routes_of = routes_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            authorization = _header(scope, b"authorization")
            if not allowed(
                method=scope["method"],
                path=scope["path"],
                authorization=authorization,
                level=route_level(self.routes_of, scope),
                api_key=self.api_key,
                admin_api_key=self.admin_api_key,
            ):
                await JSONResponse(UNAUTHORIZED, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return None
