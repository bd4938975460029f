"""The controller's HTTP API (docs/system.md §4.4), and the control routes the driver uses through
`client.ControllerClient`.

Public routes: GET /health; GET/POST /adapter_runs; GET /adapter_runs/state?names=...; GET/DELETE
/adapter_runs/{name}; GET /state (the registry snapshot). A bad request gets a 4xx with a message: 400 for a
config or name the checks reject (or neither/both of config and yaml_path), 404 for an unknown adapter, 409
when no slot is free, 422 for a body of the wrong shape; the OpenAPI schema documents each route's codes and
bodies (api_schema.py). With a key (a run's: --api-key-env from security.api_key_env), every route but /health
needs `Authorization: Bearer <key>` (401 without it). An adapter's `save` folder must lie inside the run's
adapters folder and its `data` file inside the controller's data folders (multi_lora/config.py). DELETE only
marks the adapter; its requests are aborted and its slot freed when the driver next reconciles. SIGTERM ends the
service within GRACEFUL_SHUTDOWN_S, whatever requests are still running.

Run standalone or from a saved plan: `python -m miles_runner.multi_lora.http_server --help`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from miles_runner.multi_lora.api_schema import (
    AdapterList,
    AdapterStates,
    AdapterStatus,
    Deregistered,
    Health,
    Names,
    NumStep,
    Ok,
    Registered,
    RegistryState,
    Slot,
    Step,
    error_responses,
)
from miles_runner.multi_lora.config import is_file_inside
from miles_runner.multi_lora.controller import MultiLoRAController
from miles_runner.multi_lora.registry import NoFreeSlotError, UnknownAdapterError
from miles_runner.multi_lora.settings import load_settings, parse_args
from miles_runner.sglang_client.auth import bearer_matches
from miles_runner.sglang_client.fastapi_app import fastapi_app


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt key is a 422, never silently ignored


class AdapterConfigBody(_Body):
    """An adapter's config as the API accepts it; unset keys take the run's defaults."""

    task: StrictStr | None = None
    reward: StrictStr | None = None
    rank: StrictInt | None = None
    alpha: float | None = None
    target_modules: list[StrictStr] | None = None
    lr: float | None = None
    rollout_batch_size: StrictInt | None = None
    n_samples_per_prompt: StrictInt | None = None
    num_step: StrictInt | None = None
    num_epoch: StrictInt | None = None
    data: StrictStr | None = None
    save: StrictStr | None = None
    metadata: dict[str, Any] | None = None


class RegisterBody(_Body):
    name: StrictStr
    config: AdapterConfigBody | None = None
    yaml_path: StrictStr | None = None  # relative to the controller's adapters folder


class NamesBody(_Body):
    names: list[StrictStr]


class NameBody(_Body):
    name: StrictStr


class BatchBody(_Body):
    rollout_id: StrictStr
    group_counts: dict[str, StrictInt]
    step_names: list[StrictStr]


class RolloutIdBody(_Body):
    rollout_id: StrictStr


class NumStepBody(_Body):
    name: StrictStr
    rows: StrictInt


class StepBody(_Body):
    name: StrictStr
    step: StrictInt


GRACEFUL_SHUTDOWN_S = 5


class BadRequest(ValueError):
    """A request the API refuses with 400 before it reaches the controller."""


def create_app(
    controller: MultiLoRAController, *, api_token: str | None = None, adapters_dir: str | Path | None = None
) -> FastAPI:
    """The API over `controller`. `adapters_dir` enables `yaml_path` registrations, confined to that folder."""
    app = fastapi_app(title="miles-runner multi-LoRA controller")
    app.state.controller = controller
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> Health:
        return Health(status="healthy")

    keyed: dict[str, Any] = {"dependencies": [Depends(bearer_check(api_token))], "responses": error_responses(401)}
    app.include_router(public_routes(controller, adapters_dir), **keyed)
    app.include_router(control_routes(controller), **keyed)
    return app


def public_routes(controller: MultiLoRAController, adapters_dir: str | Path | None) -> APIRouter:
    routes = APIRouter()

    # Routes that return the registry's dicts name their model in response_model (FastAPI checks the dict).
    @routes.get("/adapter_runs", response_model=AdapterList)
    async def list_adapter_runs() -> dict[str, Any]:
        return {"adapters": controller.adapter_statuses()}

    @routes.get("/adapter_runs/state", response_model=AdapterStates)  # before /adapter_runs/{name}, which would
    async def adapter_states(names: Annotated[list[str], Query()]) -> dict[str, Any]:  # otherwise match "state"
        return {"states": controller.adapter_states(names)}

    @routes.get("/adapter_runs/{name}", response_model=AdapterStatus, responses=error_responses(404))
    async def adapter_run(name: str) -> dict[str, Any]:
        return controller.adapter_status(name)

    @routes.post("/adapter_runs", response_model=Registered, responses=error_responses(400, 409))
    async def register(body: RegisterBody) -> dict[str, Any]:
        return controller.register_adapter(body.name, registration_config(body, adapters_dir))

    @routes.delete("/adapter_runs/{name}", responses=error_responses(404))
    async def deregister(name: str) -> Deregistered:
        controller.deregister_adapter(name)
        return Deregistered(status="ok", name=name)

    @routes.get("/state", response_model=RegistryState)
    async def state() -> dict[str, Any]:
        return controller.snapshot().to_dict()

    return routes


def control_routes(controller: MultiLoRAController) -> APIRouter:
    """The driver's calls (the methods a Ray actor handle would offer), one route each."""
    routes = APIRouter(prefix="/control")

    @routes.post("/retire_adapters")
    async def retire_adapters() -> Names:
        return Names(names=await controller.retire_adapters())

    @routes.post("/free_slot", responses=error_responses(400))
    async def free_slot(body: NameBody) -> Slot:
        return Slot(slot=await controller.free_slot(body.name))

    @routes.post("/record_weight_update", responses=error_responses(400, 404))
    async def record_weight_update(body: NamesBody) -> Ok:
        controller.record_weight_update(body.names)
        return Ok(status="ok")

    @routes.post("/record_batch_adapters", responses=error_responses(400))
    async def record_batch_adapters(body: BatchBody) -> Ok:
        controller.record_batch_adapters(body.rollout_id, body.group_counts, body.step_names)
        return Ok(status="ok")

    @routes.post("/mark_batch_trained", responses=error_responses(400, 404))
    async def mark_batch_trained(body: RolloutIdBody) -> Names:
        return Names(names=controller.mark_batch_trained(body.rollout_id))

    @routes.post("/resolve_num_step", responses=error_responses(400, 404))
    async def resolve_num_step(body: NumStepBody) -> NumStep:
        return NumStep(num_step=controller.resolve_num_step(body.name, body.rows))

    @routes.post("/set_adapter_step", responses=error_responses(400, 404))
    async def set_adapter_step(body: StepBody) -> Ok:
        controller.set_adapter_step(body.name, body.step)
        return Ok(status="ok")

    @routes.get("/adapter_step/{name}", responses=error_responses(404))
    async def adapter_step(name: str) -> Step:
        return Step(step=controller.adapter_step(name))

    return routes


def registration_config(body: RegisterBody, adapters_dir: str | Path | None) -> dict[str, Any]:
    """The overrides of a registration: the inline config, or a YAML file inside `adapters_dir`."""
    if body.config is not None and body.yaml_path is None:
        return body.config.model_dump(exclude_none=True)
    if body.config is not None or body.yaml_path is None:
        raise BadRequest("give exactly one of 'config' and 'yaml_path'")
    text = read_adapter_yaml(body.yaml_path, adapters_dir)
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise BadRequest(f"yaml_path {body.yaml_path!r} is not valid YAML: {error}") from error
    if not isinstance(loaded, dict):
        raise BadRequest(f"yaml_path {body.yaml_path!r} must hold a mapping of adapter config keys")
    return AdapterConfigBody.model_validate(loaded).model_dump(exclude_none=True)


def read_adapter_yaml(relative: str, adapters_dir: str | Path | None) -> str:
    """A file strictly inside `adapters_dir`: an API caller must not make the controller read anything else (nor
    learn what exists: every refusal reads the same)."""
    if adapters_dir is None:
        raise BadRequest("yaml_path is disabled: start the controller with --adapters-dir to enable it")
    root = Path(adapters_dir).resolve()
    if is_file_inside(root, relative):
        with contextlib.suppress(OSError, UnicodeDecodeError):  # unreadable, or not text
            return (root / relative).resolve().read_text()
    raise BadRequest(f"yaml_path {relative!r} is not a readable file inside the controller's adapters folder")


def bearer_check(api_token: str | None):
    async def check(request: Request) -> None:
        if api_token is not None and not bearer_matches(request.headers.get("authorization"), api_token):
            raise Unauthorized()

    return check


class Unauthorized(Exception):
    pass


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    @app.exception_handler(Unauthorized)
    async def unauthorized(_: Request, __: Unauthorized) -> JSONResponse:
        return answer(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    @app.exception_handler(UnknownAdapterError)
    async def not_found(_: Request, error: UnknownAdapterError) -> JSONResponse:
        return answer(404, str(error))

    @app.exception_handler(NoFreeSlotError)
    async def no_slot(_: Request, error: NoFreeSlotError) -> JSONResponse:
        return answer(409, str(error))

    @app.exception_handler(ValidationError)
    async def invalid(_: Request, error: ValidationError) -> JSONResponse:
        return JSONResponse({"detail": json.loads(error.json(include_url=False))}, status_code=422)

    @app.exception_handler(ValueError)  # BadRequest and every rejection by the checks and the registry
    async def rejected(_: Request, error: ValueError) -> JSONResponse:
        return answer(400, str(error))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    settings = load_settings(args)
    app = create_app(settings.build_controller(), api_token=settings.api_token, adapters_dir=settings.adapters_dir)
    # SIGTERM ends the service within GRACEFUL_SHUTDOWN_S: requests still running then (an abort waiting on an
    # engine that does not answer) are cancelled rather than waited for.
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
    )


if __name__ == "__main__":
    main()
