"""What each engine route really answers, for its OpenAPI entry: status codes, content types and bodies.

The models here document responses only (routes pass them as ``responses=``, so no answer is re-validated or
filtered on its way out). The engine answers:

- 400 for a bad request, with SGLang's error body: ``{"error": {"message"}}`` on native routes, the OpenAI error
  object on ``/v1/`` routes; LoRA and weight routes answer their own ``{"success": false, ...}`` body instead when
  the request was well formed but refused;
- 401 ``{"error": "Unauthorized"}`` when the engine has a key and the request lacks it (never on /health*);
- 499 (no body) when the client went away before its generation finished; 500 when one request failed inside a
  batched step (it alone, never the requests beside it); 503 (no body) from /health* while the engine is not serving.

FastAPI's 422 is never answered (the engine remaps body validation errors to 400, as SGLang does), so
:func:`truthful_openapi` removes it from every operation.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from miles_runner.sglang_client.fastapi_app import drop_validation_422


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorMessage(BaseModel):
    message: str


class NativeError(BaseModel):
    error: ErrorMessage


class OpenAIError(_Open):
    object: str
    message: str
    type: str
    param: str | None = None
    code: int | str


class Unauthorized(BaseModel):
    error: str


class GenerateItem(_Open):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]


class ChatCompletion(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[dict[str, Any]]
    usage: dict[str, Any]


class StatusMessage(BaseModel):
    message: str
    status: str


class LoRAReply(BaseModel):
    rid: str | None
    http_worker_ipc: str | None
    success: bool
    error_message: str | None
    loaded_adapters: dict[str, str]


class WeightsReply(_Open):
    success: bool
    message: str | None


class WeightVersionReply(BaseModel):
    success: bool
    message: str
    new_version: str


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


def _json(model: type[BaseModel] | dict[str, Any], description: str) -> dict[str, Any]:
    return (
        {"model": model, "description": description}
        if isinstance(model, type)
        else {"description": description, "content": {"application/json": {"schema": model}}}
    )


def _ref(model: type[BaseModel]) -> dict[str, Any]:
    """A schema by name (inside anyOf, where FastAPI does not collect models): truthful_openapi adds it."""
    return {"$ref": f"#/components/schemas/{model.__name__}"}


# A route's `responses=`: the documented answer for each status code.
Responses = dict[int | str, dict[str, Any]]

NO_BODY: dict[str, Any] = {"content": {}}
SSE = {"text/event-stream": {"schema": {"type": "string"}}}
UNAUTHORIZED: Responses = {401: _json(Unauthorized, "The engine has an API key and the request does not carry it")}
NATIVE_400: Responses = {400: _json(NativeError, "Bad request: the message names the field"), **UNAUTHORIZED}
OPENAI_400: Responses = {
    400: _json(OpenAIError, "Bad request (OpenAI error object): the message names the field"),
    **UNAUTHORIZED,
}
FAILED_ALONE = "This request failed inside a batched step (its neighbours were not affected)"
GONE: Responses = {499: {"description": "The client disconnected; its generation was aborted", **NO_BODY}}


def generate_responses() -> Responses:
    one_or_many = {"anyOf": [_ref(GenerateItem), {"type": "array", "items": _ref(GenerateItem)}]}
    ok = {
        "description": "One item, or a list for a batch or n > 1; an event stream when stream=true",
        "content": {"application/json": {"schema": one_or_many}, **SSE},
    }
    return {200: ok, **NATIVE_400, **GONE, 500: _json(NativeError, FAILED_ALONE)}


def chat_responses() -> Responses:
    ok = {
        "description": "A chat.completion; chat.completion.chunk events when stream=true",
        "content": {"application/json": {"schema": _ref(ChatCompletion)}, **SSE},
    }
    return {200: ok, **OPENAI_400, **GONE, 500: _json(OpenAIError, FAILED_ALONE)}


def reply_responses(model: type[BaseModel], what: str) -> Responses:
    """A LoRA or weight route: 200 and a refused request share the route's own body; a malformed body is the
    native error."""
    refused = {"anyOf": [_ref(model), _ref(NativeError)]}
    return {
        200: _json(model, f"{what} done"),
        400: _json(refused, f"{what} refused, or a malformed body"),
        **UNAUTHORIZED,
    }


ABORT: Responses = {200: {"description": "Aborted (or nothing matched)", **NO_BODY}, **NATIVE_400}
STATUS: Responses = {200: _json(StatusMessage, "Done"), **NATIVE_400}
VERSION: Responses = {200: _json(WeightVersionReply, "The new weight version"), **NATIVE_400}
MEMORY: Responses = {200: _json({"type": "null"}, "Done (null, as SGLang answers)"), **NATIVE_400}
PLAIN = {"text/plain": {"schema": {"type": "string"}}}
FLUSH: Responses = {
    200: {"description": "Flushed", "content": PLAIN},
    400: {"description": "Not flushed: requests are running or waiting", "content": PLAIN},
    **UNAUTHORIZED,
}
HEALTH: Responses = {200: {"description": "Serving", **NO_BODY}, 503: {"description": "Not serving", **NO_BODY}}
INFO: Responses = {200: _json({"type": "object"}, "Model or server information (no secrets)"), **UNAUTHORIZED}
MODELS: Responses = {200: _json(ModelList, "The base model and every loaded adapter"), **UNAUTHORIZED}
MODEL_CARD: Responses = {
    200: _json(ModelCard, "The model or adapter"),
    404: _json(OpenAIError, "No such model or adapter (code model_not_found)"),
    **UNAUTHORIZED,
}


def hand_parsed_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that parses its body itself (no FastAPI body parameter)."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


# Models referred to by _ref; truthful_openapi puts them in the document's components.
REFERENCED = (GenerateItem, ChatCompletion, NativeError, LoRAReply, WeightsReply)


def truthful_openapi(app: FastAPI) -> dict:
    """The app's OpenAPI document without the 422 the engine never answers, with the models referred to by name."""
    if app.openapi_schema is None:
        document = drop_validation_422(get_openapi(title=app.title, version=app.version, routes=app.routes))
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in REFERENCED:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        app.openapi_schema = document
    return app.openapi_schema
