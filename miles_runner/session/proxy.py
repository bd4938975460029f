"""The engine routes an agent may reach through its session, and how they are forwarded.

Upstream (docs/system.md §2.2) proxies every other `/sessions/{id}/{path}` to the engine, with the server's own engine
key. That hands anyone who reaches the session server the engine's control routes (pause_generation, load_lora_adapter,
update_weights_*, abort_request, ...) and `server_info`, which shows the engine's `api_key`. Deliberately unlike
upstream, only this allow-list is proxied, chosen from SGLang 0.5.23's route list (srt/entrypoints/http_server.py) for
what an OpenAI-style agent needs:

    GET /sessions/{id}/v1/models             model cards: the base model, then each loaded adapter
    GET /sessions/{id}/v1/models/{model}     one model card
    GET /sessions/{id}/model_info            model path, weight version, parsers (read-only; no key)
    GET /sessions/{id}/get_model_info        the same, under SGLang's older path

Generation goes only through the session's own POST .../v1/chat/completions, which records the turn and puts
the session's adapter on it. Left out on purpose: /generate, /v1/completions, /v1/responses and the other
inference routes (a turn there would be unrecorded and could name any adapter), every admin or control route,
and /server_info (the engine's configuration, keys included). Anything else under a session is a 404.

Responses are scrubbed of `api_key`/`admin_api_key` fields at any depth as a second guard; the agent's
Authorization header is never forwarded (the server owns upstream auth).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from fastapi import Response

from miles_runner.session.errors import UpstreamResponseError
from miles_runner.sglang_client.client import ROUTING_KEY_HEADER, EngineClient, EngineUnavailable

PROXIED_GET_PATHS = ("/v1/models", "/model_info", "/get_model_info")
MODEL_CARD_ROUTE = "/v1/models/{model:path}"
SECRET_FIELDS = frozenset({"api_key", "admin_api_key"})
# Engine response headers worth passing on; uvicorn writes its own server/date/length.
_KEPT_RESPONSE_HEADERS = ("content-type",)


def model_card_path(model: str) -> str | None:
    """/v1/models/{model}, or None for an id that is no model: one with a control character, or with a "." or
    ".." segment, which the HTTP client resolves as a dot segment (it also decodes %2F and %2E) and so could
    reach another engine route."""
    if any(segment in (".", "..") for segment in model.split("/")) or any(c < " " or c == "\x7f" for c in model):
        return None
    return "/v1/models/" + quote(model, safe="/")


async def forward_get(target: EngineClient, session_id: str, path: str) -> Response:
    """GET `path` on the session's engine (or the router, by the session's routing key), keys scrubbed."""
    try:
        upstream = await target.request("GET", path, headers={ROUTING_KEY_HEADER: session_id})
    except EngineUnavailable as error:
        raise UpstreamResponseError(f"backend transport error: {error}") from error
    headers = {k: v for k, v in upstream.headers.items() if k.lower() in _KEPT_RESPONSE_HEADERS}
    return Response(scrub_secrets(upstream.content), status_code=upstream.status_code, headers=headers)


def scrub_secrets(content: bytes) -> bytes:
    """A JSON body without any `api_key`/`admin_api_key` field; anything else unchanged."""
    try:
        body = json.loads(content)
    except (ValueError, RecursionError):
        return content
    cleaned = _without_secrets(body)
    return content if cleaned == body else json.dumps(cleaned, separators=(",", ":")).encode()


def _without_secrets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_secrets(v) for k, v in value.items() if k not in SECRET_FIELDS}
    if isinstance(value, list):
        return [_without_secrets(item) for item in value]
    return value
