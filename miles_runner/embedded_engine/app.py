"""HTTP routes of the embedded engine, with SGLang's paths, bodies, status codes and error bodies.

Errors: a ``ValueError`` (bad input, unknown adapter ...) is HTTP 400 with ``{"error": {"message"}}`` on
native routes and the OpenAI error object on ``/v1/`` routes; a body that fails validation is also 400 (as
late-2025+ SGLang remaps FastAPI's 422), its message naming the field. A client that disconnects has its
requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles_runner.core.sglang_protocol import LORA_BROADCAST_ROUTE, MILES_FORK
from miles_runner.embedded_engine import openai_chat
from miles_runner.embedded_engine import openapi_docs as docs
from miles_runner.embedded_engine.engine import EmbeddedEngine
from miles_runner.embedded_engine.json_response import OrjsonResponse, sse_event
from miles_runner.embedded_engine.native_response import generate_item
from miles_runner.embedded_engine.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    ContinueGenerationReqInput,
    DestroyWeightsUpdateGroupReqInput,
    GenerateReqInput,
    InitWeightsUpdateGroupReqInput,
    LoadLoRAAdapterFromDistributedReqInput,
    LoadLoRAAdapterFromTensorsReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from miles_runner.embedded_engine.request import GenerationResult, GenRequest
from miles_runner.sglang_client.auth import admin_optional, install_auth
from miles_runner.sglang_client.fastapi_app import fastapi_app

logger = logging.getLogger(__name__)
BodyModel = TypeVar("BodyModel", bound=pydantic.BaseModel)

DISCONNECT_POLL_S = 0.5
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", "20"))
LORA = docs.reply_responses(docs.LoRAReply, "The adapter operation")
WEIGHTS = docs.reply_responses(docs.WeightsReply, "The weight operation")
TENSORS_BODY = docs.hand_parsed_body(LoadLoRAAdapterFromTensorsReqInput)
FLUSH_OK = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def create_app(engine: EmbeddedEngine) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await engine.start()
        yield
        engine.shutdown()

    app = fastapi_app(title="miles-runner embedded engine", lifespan=lifespan)
    _install_error_handlers(app)
    install_auth(app, api_key=engine.args.api_key, admin_api_key=engine.args.admin_api_key)
    _add_generation_routes(app, engine)
    _add_control_routes(app, engine)
    _add_lora_and_weight_routes(app, engine)
    _add_distributed_weight_routes(app, engine)
    _add_info_routes(app, engine)
    app.openapi = lambda: docs.truthful_openapi(app)  # type: ignore[method-assign]
    return app


# ----- errors and auth ---------------------------------------------------------------------------------------
def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1/")


def error_response(request: Request, message: str, status: int = 400) -> JSONResponse:
    if _is_openai(request):
        err_type = "BadRequestError" if status < 500 else "InternalServerError"
        return JSONResponse(openai_chat.openai_error(message, status, err_type), status_code=status)
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems: dict[str, list[str]] = {}  # per field, each distinct message (one per union member it failed)
        for path, error in _without_union_noise(exc.errors()):
            field = ".".join(str(part) for part in path) or "body"
            problems.setdefault(field, []).append(error.get("msg", "invalid"))
        text = "; ".join(f"{field}: {' or '.join(dict.fromkeys(msgs))}" for field, msgs in problems.items())
        return error_response(request, text)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400:  # a body FastAPI cannot read (not UTF-8 ...): the engine's 400 body, as any other
            return error_response(request, f"body: {exc.detail}")
        return await http_exception_handler(request, exc)  # 404, 405: FastAPI's own, as SGLang answers them

    @app.exception_handler(ValueError)
    async def bad_value(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(request, str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(request, f"Internal server error: {exc}", 500)


def _without_union_noise(errors: Sequence[dict[str, Any]]) -> list[tuple[tuple, dict]]:
    """(field path, error) of the errors that say what is wrong. A value that fails every member of a union
    (`sampling_params`: one or a list) gets an error per member: an error deeper in the value, or one that is not
    a mere type mismatch at the same place, says more than "not a list"."""
    located = [(_field_path(error), error) for error in errors]

    def says_more(path: tuple, error: dict) -> bool:
        return any(
            (len(other) > len(path) and other[: len(path)] == path)
            or (other == path and _type_mismatch(error) and not _type_mismatch(other_error))
            for other, other_error in located
        )

    return [(path, error) for path, error in located if not says_more(path, error)] or located


def _field_path(error: dict) -> tuple:
    """The field path into the body, without pydantic's union member names (`SamplingParams`, `list[int]`,
    `str`); the fields here are snake_case and none is named after a type."""
    if error.get("type") == "json_invalid":
        return ()
    return tuple(part for part in error.get("loc", ())[1:] if not _union_member(part))


def _union_member(part: object) -> bool:
    return isinstance(part, str) and (part[:1].isupper() or "[" in part or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _type_mismatch(error: dict) -> bool:
    return error.get("type", "").endswith("_type")


# ----- generation ------------------------------------------------------------------------------------------
async def _collect(engine: EmbeddedEngine, requests: list[GenRequest], parent: str | None) -> list[GenerationResult]:
    finals: dict[int, GenerationResult] = {}
    async for index, result in engine.generate(requests, parent_rid=parent):
        if result.finish_reason is not None:
            finals[index] = result
    return [finals[i] for i in range(len(requests))]


async def _unless_disconnected(request: Request, work) -> list[GenerationResult] | None:
    """Await ``work``; if the client goes away first, cancel it (which aborts its requests) and return None."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return None
    return task.result()


def _error_abort(results: list[GenerationResult]) -> dict | None:
    """An abort carrying a status code (e.g. an internal failure) becomes an HTTP error, as in SGLang."""
    for result in results:
        reason = result.finish_reason or {}
        if reason.get("type") == "abort" and reason.get("status_code"):
            return reason
    return None


def _add_generation_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    @app.api_route("/generate", methods=["POST", "PUT"], responses=docs.generate_responses())
    async def generate(body: GenerateReqInput, request: Request):
        requests, as_list = engine.build_generate_requests(body)
        parent = body.rid if isinstance(body.rid, str) else None
        if body.stream:
            return StreamingResponse(_native_stream(requests, as_list, parent), media_type="text/event-stream")
        results = await _unless_disconnected(request, _collect(engine, requests, parent))
        if results is None:
            return Response(status_code=499)
        failed = _error_abort(results)
        if failed is not None:
            return error_response(request, failed["message"], failed["status_code"])
        items = [generate_item(r) for r in results]
        return OrjsonResponse(items if as_list else items[0])

    async def _native_stream(requests: list[GenRequest], as_list: bool, parent: str | None) -> AsyncIterator[bytes]:
        async for index, result in engine.generate(requests, parent_rid=parent):
            failed = _error_abort([result])
            if failed is not None:
                yield sse_event({"error": {"message": failed["message"]}})
                break
            yield sse_event(generate_item(result, index if as_list else None))
        yield b"data: [DONE]\n\n"

    @app.post("/v1/chat/completions", responses=docs.chat_responses())
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        rid, requests = openai_chat.build_chat_requests(engine, body)
        if body.stream:
            stream = openai_chat.chat_stream(engine, body, rid, requests)
            return StreamingResponse(stream, media_type="text/event-stream")
        results = await _unless_disconnected(request, _collect(engine, requests, rid))
        if results is None:
            return Response(status_code=499)
        failed = _error_abort(results)
        if failed is not None:
            return error_response(request, failed["message"], failed["status_code"])
        return openai_chat.chat_response(body, rid, requests, results)


# ----- abort, pause, cache -----------------------------------------------------------------------------------
def _add_control_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    # As in SGLang, these routes require a JSON body (`{}` takes every default).
    @app.post("/abort_request", responses=docs.ABORT, response_class=Response)
    @admin_optional
    async def abort_request(body: AbortReqInput):
        # `prefix` is a fork-only field: an engine serving as stock SGLang drops it, as stock does.
        prefix = body.prefix and engine.args.engine_build == MILES_FORK
        await engine.abort(body.rid, abort_all=body.abort_all, prefix=prefix)
        return Response(status_code=200)

    @app.post("/pause_generation", responses=docs.STATUS)
    @admin_optional
    async def pause_generation(body: PauseGenerationReqInput):
        await engine.pause(body.mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation", responses=docs.STATUS)
    @admin_optional
    async def continue_generation(_body: ContinueGenerationReqInput):
        await engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # SGLang takes both verbs and a required body, and answers null (memory_occupation.py).
    @app.api_route("/release_memory_occupation", methods=["GET", "POST"], responses=docs.MEMORY)
    @admin_optional
    async def release_memory_occupation(body: ReleaseMemoryOccupationReqInput) -> None:
        await engine.release_memory_occupation(body.tags)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"], responses=docs.MEMORY)
    @admin_optional
    async def resume_memory_occupation(body: ResumeMemoryOccupationReqInput) -> None:
        await engine.resume_memory_occupation(body.tags)

    @app.api_route("/flush_cache", methods=["GET", "POST"], responses=docs.FLUSH, response_class=PlainTextResponse)
    @admin_optional
    async def flush_cache():
        if await engine.flush_cache():
            return PlainTextResponse(FLUSH_OK)
        return PlainTextResponse("Cache not flushed: requests are running or waiting.\n", status_code=400)


# ----- LoRA and weights --------------------------------------------------------------------------------------
def _lora_reply(engine: EmbeddedEngine, error: str | None = None) -> JSONResponse:
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": error is None,
        "error_message": error,
        "loaded_adapters": engine.lora.loaded_adapters(),
    }
    return JSONResponse(body, status_code=200 if error is None else 400)


def _weights_reply(message: str | None, error: str | None = None, **extra) -> JSONResponse:
    body = {"success": error is None, "message": error or message, **extra}
    return JSONResponse(body, status_code=200 if error is None else 400)


def _add_lora_and_weight_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    @app.post("/load_lora_adapter", responses=LORA)
    @admin_optional
    async def load_lora_adapter(body: LoadLoRAAdapterReqInput):
        try:
            await engine.load_lora(body.lora_name, body.lora_path, body.pinned)
        except ValueError as exc:
            return _lora_reply(engine, str(exc))
        return _lora_reply(engine)

    @app.post("/load_lora_adapter_from_tensors", responses=LORA, openapi_extra=TENSORS_BODY)
    @admin_optional
    async def load_lora_adapter_from_tensors(request: Request):
        body = await _large_body(request, LoadLoRAAdapterFromTensorsReqInput)
        try:
            await engine.load_lora_from_tensors(body)
        except ValueError as exc:
            return _lora_reply(engine, str(exc))
        return _lora_reply(engine)

    load_lora_adapter_from_tensors.body_model = LoadLoRAAdapterFromTensorsReqInput  # type: ignore[attr-defined]  # FastAPI sees no body param

    @app.post("/unload_lora_adapter", responses=LORA)
    @admin_optional
    async def unload_lora_adapter(body: UnloadLoRAAdapterReqInput):
        try:
            await engine.unload_lora(body.lora_name)
        except ValueError as exc:
            return _lora_reply(engine, str(exc))
        return _lora_reply(engine)

    @app.post("/update_weights_from_disk", responses=WEIGHTS)
    @admin_optional
    async def update_weights_from_disk(body: UpdateWeightFromDiskReqInput):
        try:
            message = await engine.update_weights_from_disk(body)
        except (ValueError, OSError) as exc:
            return _weights_reply(None, f"Failed to update weights: {exc}", num_paused_requests=0)
        return _weights_reply(message, num_paused_requests=0)

    @app.post("/update_weights_from_tensor", responses=WEIGHTS)
    @admin_optional
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorReqInput):
        try:
            message = await engine.update_weights_from_tensor(body)
        except ValueError as exc:
            return _weights_reply(None, f"Failed to update weights: {exc}")
        return _weights_reply(message)

    @app.post("/update_weight_version", responses=docs.VERSION)
    @admin_optional
    async def update_weight_version(body: UpdateWeightVersionReqInput):
        await engine.update_weight_version(body.new_version, body.abort_all_requests)
        message = f"Weight version updated to {body.new_version}"
        return {"success": True, "message": message, "new_version": body.new_version}


async def _large_body(request: Request, model: type[BodyModel]) -> BodyModel:
    """A body that carries tensors (megabytes of base64), validated by pydantic's own JSON parser: FastAPI's way
    (json.loads, then validating the dict) is several times slower on them (bench/adapter_sync_bandwidth.py). A bad
    body reaches the same handler, with the same field paths, as FastAPI's own validation errors. Such a route
    names its model in `endpoint.body_model`, where the protocol tests read it."""
    try:
        return model.model_validate_json(await request.body())
    except pydantic.ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from exc


# ----- weights and adapters broadcast by the trainer (disaggregated sync) -----------------------------------
def _add_distributed_weight_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    @app.post("/init_weights_update_group", responses=WEIGHTS)
    @admin_optional
    async def init_weights_update_group(body: InitWeightsUpdateGroupReqInput):
        try:
            await engine.init_weights_update_group(body)
        except ValueError as exc:
            return _weights_reply(None, str(exc))
        return _weights_reply(f"Initialized weight update group {body.group_name}.")

    @app.post("/destroy_weights_update_group", responses=WEIGHTS)
    @admin_optional
    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupReqInput):
        try:
            await engine.weight_groups.destroy(body.group_name)
        except ValueError as exc:
            return _weights_reply(None, str(exc))
        return _weights_reply(f"Destroyed weight update group {body.group_name}.")

    @app.post("/update_weights_from_distributed", responses=WEIGHTS)
    @admin_optional
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedReqInput):
        try:
            message = await engine.update_weights_from_distributed(body)
        except ValueError as exc:
            return _weights_reply(None, f"Failed to update weights: {exc}")
        return _weights_reply(message)

    if engine.args.engine_build != MILES_FORK:
        return  # a fork-only route: an engine serving as stock SGLang answers 404, as stock does

    @app.post(LORA_BROADCAST_ROUTE, responses=LORA)
    @admin_optional
    async def load_lora_adapter_from_distributed(body: LoadLoRAAdapterFromDistributedReqInput):
        try:
            await engine.load_lora_from_distributed(body)
        except ValueError as exc:
            return _lora_reply(engine, str(exc))
        return _lora_reply(engine)


# ----- health and info ---------------------------------------------------------------------------------------
def _add_info_routes(app: FastAPI, engine: EmbeddedEngine) -> None:
    @app.get("/health", responses=docs.HEALTH, response_class=Response)
    async def health():
        return Response(status_code=200 if engine.ready and engine.scheduler.alive else 503)

    @app.get("/health_generate", responses=docs.HEALTH, response_class=Response)
    async def health_generate():
        if not (engine.ready and engine.scheduler.alive):
            return Response(status_code=503)
        probe = engine.build_generate_requests(
            GenerateReqInput(
                input_ids=[0],
                sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                rid=f"HEALTH_CHECK_{os.urandom(4).hex()}",
            )
        )[0]
        try:
            await asyncio.wait_for(_collect(engine, probe, None), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/model_info", responses=docs.INFO)
    @app.get("/get_model_info", responses=docs.INFO)
    async def model_info():
        return engine.model_info()

    @app.get("/server_info", responses=docs.INFO)
    @app.get("/get_server_info", responses=docs.INFO)
    async def server_info():
        return engine.server_info()

    @app.get("/v1/models", responses=docs.MODELS)
    async def models():
        return {"object": "list", "data": engine.model_cards()}

    @app.get("/v1/models/{model_id:path}", responses=docs.MODEL_CARD)
    async def model_card(model_id: str):
        for card in engine.model_cards():
            if card["id"] == model_id:
                return card
        body = openai_chat.openai_error(f"The model '{model_id}' does not exist", 404, "NotFoundError")
        return JSONResponse({**body, "code": "model_not_found"}, status_code=404)
