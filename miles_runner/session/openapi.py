"""What the session server's OpenAPI entries say: every status code, content type and body a route really
answers with, and schemas for the request bodies the routes parse by hand (body.py), so API-level tests
(schemathesis) can check the server against its own description. Plain JSON-schema dicts: documenting adds
no validation, so the accepted input stays exactly what the handlers accept.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from miles_runner.sglang_client.fastapi_app import drop_validation_422

ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
# An engine error passed through as it came: SGLang's {"error": {...}} or {"object": "error", ...}, or text.
ENGINE_ERROR = {"application/json": {"schema": {"type": "object"}}, "text/plain": {"schema": {"type": "string"}}}
ADAPTER = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "lora_name": {"type": "string", "minLength": 1},
        "version": {"type": "integer", "minimum": 0},
    },
    "required": ["name", "lora_name"],
    "additionalProperties": False,
}
CREATE_BODY = {"type": "object", "properties": {"adapter": {"anyOf": [ADAPTER, {"type": "null"}]}}}
SAMPLES_BODY = {
    "type": "object",
    "properties": {
        "max_seq_len": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]},
        "metadata": {"anyOf": [{"type": "object"}, {"type": "null"}]},
    },
}
MESSAGE = {"type": "object", "properties": {"role": {"type": "string"}}, "required": ["role"]}
CHAT_BODY = {
    "type": "object",
    "description": "An OpenAI chat request (the turn is generated as SGLang /generate; chat.py fields it "
    "cannot honour are a 400 naming them). Numbers must be finite.",
    "properties": {
        "model": {"type": "string"},
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": {"type": "number", "minimum": 0},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "stream": {"type": "boolean"},
    },
    "required": ["messages"],
}
CHAT_COMPLETION = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"type": "string"}, "choices": {"type": "array"}},
    "required": ["choices"],
}
SESSION_ID = {"type": "object", "properties": {"session_id": {"type": "string"}}, "required": ["session_id"]}
SESSION = {
    "type": "object",
    "properties": {
        "session_id": {"type": "string"},
        "records": {"type": "array", "items": {"type": "object"}},
        "metadata": {"type": "object"},
    },
    "required": ["session_id", "records", "metadata"],
}
SSE_EVENT = {  # one server-sent event as schemathesis parses it: a chat.completion.chunk, then [DONE]
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
HEALTH = {
    "type": "object",
    "properties": {"status": {"const": "ok"}, "session_server_instance_id": {"type": "string"}},
    "required": ["status"],
}

_WHY = {
    400: "bad request body (invalid JSON, a non-finite number, a field the turn cannot honour)",
    401: "missing or wrong bearer key (the server was started with the run's key)",
    404: "unknown, deleted or expired session",
    409: "v1: a turn is already in flight on this session; v2: a truncated node; the turn was not recorded",
    429: "session.max_sessions sessions are open",
    500: "the stored token prefix is not a prefix of prompt+completion (docs/system.md §2.3)",
    502: "the engine could not be reached, timed out, or answered without what a record needs",
    503: "the server is shutting down",
}


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def errors(*codes: int, authenticated: bool, passthrough: bool = False) -> dict[int | str, dict[str, Any]]:
    """JSON {"error"} responses for `codes`, plus 401 when the server requires a key. `passthrough`: the route
    also passes an engine's error reply on as it came (any 4xx/5xx, JSON or text), so each code may carry
    either body."""
    chosen = sorted({*codes, 401} if authenticated else set(codes))
    if not passthrough:
        return {code: json_response(ERROR, _WHY[code]) for code in chosen}
    responses: dict[int | str, dict[str, Any]] = {
        code: {"description": f"{_WHY[code]}; or the engine's own error", "content": ENGINE_ERROR} for code in chosen
    }
    for code in ("4XX", "5XX"):
        responses[code] = {"description": "an engine error reply, passed through unrecorded", "content": ENGINE_ERROR}
    return responses


def request_body(schema: dict[str, Any], *, required: bool) -> dict[str, Any]:
    """openapi_extra for a body the handler parses itself."""
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


CHAT_OK = {
    "description": "the chat completion (replay payloads removed), or with stream=true one SSE chunk and [DONE]",
    "content": {
        "application/json": {"schema": CHAT_COMPLETION},
        "text/event-stream": {"schema": SSE_EVENT},
    },
}
SAMPLES_OK = {
    "description": "the session's training samples: safetensors (session/codec.py)",
    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
}
SAMPLES_UNUSABLE = {
    "description": "the records cannot make a sample (the reason, as text)",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}
PROXIED_OK = json_response({"type": "object"}, "the engine's JSON reply (api_key fields removed)")


def drop_unreachable_validation_errors(app: FastAPI) -> None:
    """FastAPI documents a 422 HTTPValidationError on every route with parameters. These routes take only string
    path parameters and parse their bodies themselves, so that 422 never comes: leave it out of the schema."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            drop_validation_422(build())  # build() caches the document in app.openapi_schema
        return build()  # the cached document

    app.openapi = openapi  # type: ignore[method-assign]
