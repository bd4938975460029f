"""HTTP routes of the session server (spec §2.2); the logic lives in `core.SessionCore`.

    GET    /health                                  {"status": "ok", "session_server_instance_id"?}
    POST   /sessions                                {"session_id"}; optional body {"adapter": {...}}
    GET    /sessions/{id}                           {"session_id", "records", "metadata"}
    DELETE /sessions/{id}                           204
    POST   /sessions/{id}/v1/chat/completions       OpenAI chat (agents use base_url=.../sessions/{id}/v1)
    POST   /sessions/{id}/samples                   {"max_seq_len", "metadata"} -> safetensors (codec.py)
    *      /sessions/{id}/{path}                    proxied to the router (X-SMG-Routing-Key) or the session's engine

Multi-LoRA: POST /sessions {"adapter": {"name": "tenant-a", "lora_name": "__miles_slot_0", "version": 3}}
binds the session to an adapter slot; every turn then carries lora_path=the slot, rid="tenant-a::<uuid>" and
extra_key="tenant-a:v3" (overriding the server-wide adapter name and whatever the agent sent). Errors are
JSON {"error": msg} with the codes of errors.py; /samples answers 422 text/plain when the records cannot
make a sample.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from miles_runner.engine.client import ROUTING_KEY_HEADER, EngineError, EngineUnavailable
from miles_runner.engine.fastapi_app import fastapi_app
from miles_runner.session.config import AdapterSlot, SessionServerConfig, read_sampling_defaults
from miles_runner.session.core import SessionCore
from miles_runner.session.errors import MessageValidationError, SessionError, UpstreamResponseError
from miles_runner.session.request import fake_stream, strip_replay_payloads
from miles_runner.session.tito import TitoTokenizer
from miles_runner.session.upstream import SessionUpstream

PROXY_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
# Hop-by-hop and per-connection headers, plus the agent's credentials (the server owns upstream auth).
_DROPPED_REQUEST_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "authorization"})
# uvicorn writes its own server/date; httpx already decoded the body and recomputes the length.
_DROPPED_RESPONSE_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "content-encoding", "server", "date", "connection"}
)
_SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


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
        try:
            app.state.core = SessionCore(config, tito, upstream, num_layers, sampling_defaults)
            yield
        finally:
            await upstream.aclose()

    app = fastapi_app(title="miles-runner session server", lifespan=lifespan)
    app.add_exception_handler(SessionError, _session_error_response)
    _add_routes(app, config)
    return app


def _add_routes(app: FastAPI, config: SessionServerConfig) -> None:
    def core(request: Request) -> SessionCore:
        return request.app.state.core

    @app.get("/health")
    async def health() -> dict[str, Any]:
        body: dict[str, Any] = {"status": "ok"}
        if config.instance_id is not None:
            body["session_server_instance_id"] = config.instance_id
        return body

    @app.post("/sessions")
    async def create_session(request: Request) -> dict[str, str]:
        body = await _json_object(request, allow_empty=True)
        try:
            adapter = AdapterSlot.from_json(body["adapter"]) if body.get("adapter") is not None else None
        except ValueError as error:
            raise MessageValidationError(str(error)) from error
        return {"session_id": core(request).create(adapter).session_id}

    @app.get("/sessions/{session_id}")
    async def get_session(session_id: str, request: Request) -> dict[str, Any]:
        return core(request).describe(core(request).get(session_id))

    @app.delete("/sessions/{session_id}", status_code=204)
    async def delete_session(session_id: str, request: Request) -> Response:
        await core(request).delete(session_id)
        return Response(status_code=204)

    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def chat_completions(session_id: str, request: Request) -> Response:
        body = await _json_object(request)
        try:
            result = await core(request).chat_completions(session_id, body)
        except EngineError as error:
            return _engine_error_response(error)
        reply = strip_replay_payloads(result.response)
        if result.stream:
            return StreamingResponse(fake_stream(reply), media_type="text/event-stream", headers=_SSE_HEADERS)
        return JSONResponse(reply)

    # Registered before the catch-all below, which would otherwise proxy /samples to the engine.
    @app.post("/sessions/{session_id}/samples")
    async def samples(session_id: str, request: Request) -> Response:
        body = await _json_object(request, allow_empty=True)
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

    @app.api_route("/sessions/{session_id}/{path:path}", methods=PROXY_METHODS)
    async def proxy(session_id: str, path: str, request: Request) -> Response:
        core(request).get(session_id)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_REQUEST_HEADERS}
        headers[ROUTING_KEY_HEADER] = session_id
        try:
            target = await core(request).upstream.proxy_target(session_id)
            upstream = await target.request(
                request.method,
                f"/{path}",
                content=await request.body(),
                headers=headers,
                params=request.query_params,
            )
        except EngineUnavailable as error:
            raise UpstreamResponseError(f"backend transport error: {error}") from error
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS}
        return Response(upstream.content, status_code=upstream.status_code, headers=kept)


async def _json_object(request: Request, *, allow_empty: bool = False) -> dict[str, Any]:
    raw = await request.body()
    if allow_empty and not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise MessageValidationError(f"invalid JSON body: {error}") from error
    if not isinstance(body, dict):
        raise MessageValidationError("the JSON body must be an object")
    return body


async def _session_error_response(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, SessionError)
    return JSONResponse({"error": error.message}, status_code=error.status_code)


def _engine_error_response(error: EngineError) -> Response:
    """A non-2xx engine reply goes back to the agent as it came (and is not recorded)."""
    if isinstance(error.body, dict | list):
        return JSONResponse(error.body, status_code=error.status_code)
    return PlainTextResponse(str(error.body or error.message), status_code=error.status_code)
