"""HTTP routes of the session server (docs/system.md §2.2); the logic lives in `core.SessionCore`.

    GET    /health                                  {"status": "ok", "session_server_instance_id"?}
    POST   /sessions                                {"session_id"}; optional body {"adapter": {...}}
    GET    /sessions/{id}                           {"session_id", "records", "metadata"}
    DELETE /sessions/{id}                           204 (aborts the session's in-flight turns on the engine)
    POST   /sessions/{id}/v1/chat/completions       OpenAI chat (agents use base_url=.../sessions/{id}/v1)
    POST   /sessions/{id}/samples                   {"max_seq_len", "metadata"} -> safetensors (codec.py)
    GET    /sessions/{id}/v1/models[/{model}], /sessions/{id}/model_info
                                                    proxied to the router (X-SMG-Routing-Key) or the session's
                                                    engine: an allow-list, unlike upstream (proxy.py says why)

Multi-LoRA: POST /sessions {"adapter": {"name": "tenant-a", "lora_name": "__miles_slot_0", "version": 3}}
binds the session to an adapter slot; every turn then carries lora_path=the slot, rid="tenant-a::<uuid>" and
extra_key="tenant-a:v3" (overriding the server-wide adapter name and whatever the agent sent). Errors are
JSON {"error": msg} with the codes of errors.py; /samples answers 422 text/plain when the records cannot
make a sample. With `api_key` set every route but GET /health needs `Authorization: Bearer <key>` (401).
The OpenAPI entries (openapi.py) list every status code and body each route answers with.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from miles_runner.session import openapi as doc
from miles_runner.session.body import parse_json_object
from miles_runner.session.config import AdapterSlot, SessionServerConfig, read_sampling_defaults
from miles_runner.session.core import SessionCore
from miles_runner.session.errors import MessageValidationError, SessionError
from miles_runner.session.proxy import MODEL_CARD_ROUTE, PROXIED_GET_PATHS, forward_get, model_card_path
from miles_runner.session.request import fake_stream, strip_replay_payloads
from miles_runner.session.tito import TitoTokenizer
from miles_runner.session.upstream import SessionUpstream
from miles_runner.sglang_client.auth import install_auth
from miles_runner.sglang_client.client import EngineError
from miles_runner.sglang_client.fastapi_app import fastapi_app

_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
MAX_REAP_INTERVAL_S = 60.0


def create_app(config: SessionServerConfig, tito: TitoTokenizer | None = None) -> FastAPI:
    tito = tito or TitoTokenizer.from_model_path(config.model_path, config.tito_model)
    num_layers = config.resolved_num_layers()
    sampling_defaults = read_sampling_defaults(Path(config.model_path))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upstream = SessionUpstream(
            config.engine_url,
            behind_router=config.behind_router,
            engine_urls=config.engine_urls,
            api_key=config.upstream_api_key,
            timeout_s=config.upstream_timeout_s,
        )
        reaper: asyncio.Task | None = None
        try:
            app.state.core = SessionCore(config, tito, upstream, num_layers, sampling_defaults)
            reaper = asyncio.create_task(_reap_expired(app.state.core))
            yield
        finally:
            if reaper is not None:
                reaper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reaper
            await upstream.aclose()

    app = fastapi_app(title="miles-runner session server", lifespan=lifespan)
    app.add_exception_handler(SessionError, _session_error_response)
    app.add_exception_handler(HTTPException, _http_error_response)
    _add_routes(app, config)
    doc.drop_unreachable_validation_errors(app)
    # Every route is SGLang's NORMAL level: the run's key, except the always-open /health (sglang_client/auth.py).
    install_auth(app, api_key=config.api_key, admin_api_key=None)
    return app


async def stop_turns(app: FastAPI) -> None:
    """On SIGTERM, before uvicorn waits for open requests: refuse new turns and abort the running ones."""
    core: SessionCore | None = getattr(app.state, "core", None)
    if core is not None:
        await core.shutdown()


async def _reap_expired(core: SessionCore) -> None:
    """Frees sessions past max_age_s that nobody touches again (a touched one is reaped on the spot)."""
    while True:
        await asyncio.sleep(min(core.config.max_age_s, MAX_REAP_INTERVAL_S))
        await core.expire_old_sessions()


def _add_routes(app: FastAPI, config: SessionServerConfig) -> None:
    keyed = config.api_key is not None

    def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
        return doc.errors(*codes, authenticated=keyed)

    def core(request: Request) -> SessionCore:
        return request.app.state.core

    @app.get("/health", responses={200: doc.json_response(doc.HEALTH, "the server is up")})
    async def health() -> dict[str, Any]:
        body: dict[str, Any] = {"status": "ok"}
        if config.instance_id is not None:
            body["session_server_instance_id"] = config.instance_id
        return body

    @app.post(
        "/sessions",
        responses={200: doc.json_response(doc.SESSION_ID, "the new session"), **errors(400, 429, 503)},
        openapi_extra=doc.request_body(doc.CREATE_BODY, required=False),
    )
    async def create_session(request: Request) -> dict[str, str]:
        body = parse_json_object(await request.body(), allow_empty=True)
        try:
            adapter = AdapterSlot.from_json(body["adapter"]) if body.get("adapter") is not None else None
        except ValueError as error:
            raise MessageValidationError(str(error)) from error
        return {"session_id": (await core(request).create(adapter)).session_id}

    @app.get(
        "/sessions/{session_id}",
        responses={200: doc.json_response(doc.SESSION, "the session's records and metadata"), **errors(404)},
    )
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        return core(request).describe(core(request).get(session_id))

    @app.delete(
        "/sessions/{session_id}",
        status_code=204,
        response_class=Response,
        responses={204: {"description": "deleted; its in-flight turns were aborted"}, **errors(404)},
    )
    async def delete_session(session_id: str, request: Request) -> Response:
        await core(request).delete(session_id)
        return Response(status_code=204)

    @app.post(
        "/sessions/{session_id}/v1/chat/completions",
        response_class=Response,
        responses={
            200: doc.CHAT_OK,
            **doc.errors(400, 404, 409, 500, 502, 503, authenticated=keyed, passthrough=True),
        },
        openapi_extra=doc.request_body(doc.CHAT_BODY, required=True),
    )
    async def chat_completions(session_id: str, request: Request) -> Response:
        body = parse_json_object(await request.body())
        try:
            result = await core(request).chat_completions(session_id, body)
        except EngineError as error:
            return _engine_error_response(error)
        reply = strip_replay_payloads(result.response)
        if result.stream:
            return StreamingResponse(fake_stream(reply), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(reply)

    @app.post(
        "/sessions/{session_id}/samples",
        response_class=Response,
        responses={200: doc.SAMPLES_OK, 422: doc.SAMPLES_UNUSABLE, **errors(400, 404)},
        openapi_extra=doc.request_body(doc.SAMPLES_BODY, required=False),
    )
    async def samples(session_id: str, request: Request) -> Response:
        body = parse_json_object(await request.body(), allow_empty=True)
        max_seq_len, agent_metadata = body.get("max_seq_len"), body.get("metadata") or {}
        if max_seq_len is not None and (type(max_seq_len) is not int or max_seq_len <= 0):
            raise MessageValidationError("max_seq_len must be a positive integer or null")
        if not isinstance(agent_metadata, dict):
            raise MessageValidationError("metadata must be an object")
        session = core(request).get(session_id)
        try:
            blob = core(request).collect_samples(session, max_seq_len, agent_metadata)
        except (ValueError, AssertionError) as error:
            return PlainTextResponse(str(error), status_code=422)
        return Response(blob, media_type="application/octet-stream")

    _add_proxied_routes(app, keyed)


def _add_proxied_routes(app: FastAPI, keyed: bool) -> None:
    """The allow-listed engine routes (proxy.py); every other session path is a 404."""
    responses = {200: doc.PROXIED_OK, **doc.errors(404, 502, authenticated=keyed, passthrough=True)}

    async def forward(session_id: str, path: str, request: Request) -> Response:
        core: SessionCore = request.app.state.core
        core.get(session_id)
        return await forward_get(await core.upstream.proxy_target(session_id), session_id, path)

    def proxied_route(path: str):
        # `path` is closed over, never a handler parameter: FastAPI would read a parameter from the query string.
        async def proxied(session_id: str, request: Request) -> Response:
            return await forward(session_id, path, request)

        return proxied

    for path in PROXIED_GET_PATHS:
        app.add_api_route(
            f"/sessions/{{session_id}}{path}",
            proxied_route(path),
            methods=["GET"],
            response_class=Response,
            responses=responses,
            name=f"proxy {path}",
        )

    @app.get(f"/sessions/{{session_id}}{MODEL_CARD_ROUTE}", response_class=Response, responses=responses)
    async def model_card(session_id: str, model: str, request: Request) -> Response:
        path = model_card_path(model)
        if path is None:
            return JSONResponse({"error": f"the model {model!r} does not exist"}, status_code=404)
        return await forward(session_id, path, request)


async def _session_error_response(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, SessionError)
    return JSONResponse({"error": error.message}, status_code=error.status_code)


async def _http_error_response(request: Request, error: Exception) -> Response:
    """Routing errors (an unknown or non-proxied path: 404, a wrong method: 405) in the {"error"} envelope."""
    assert isinstance(error, HTTPException)
    message = f"{request.method} {request.url.path}: {error.detail}"
    if error.status_code == 404 and request.url.path.startswith("/sessions/"):
        message += " (the session server serves only the routes of its OpenAPI schema; see session/proxy.py)"
    return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)


def _engine_error_response(error: EngineError) -> Response:
    """A non-2xx engine reply goes back to the agent as it came (and is not recorded)."""
    if isinstance(error.body, dict | list):
        return JSONResponse(error.body, status_code=error.status_code)
    return PlainTextResponse(str(error.body or error.message), status_code=error.status_code)
