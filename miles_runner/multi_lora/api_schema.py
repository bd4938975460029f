"""What the controller's routes answer, as models: the OpenAPI schema documents every status code a route can
return and the body of each, so an API-level test (schemathesis) can check the server against it.

Errors are `{"detail": "<message>"}` (400, 401, 404, 409), or FastAPI's validation body (422). The response
models mirror the registry's dicts (registry.status, RegistrySnapshot.to_dict) field for field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorBody(BaseModel):
    detail: str


ERRORS = {
    400: "a body that is not JSON (Starlette's answer), or a config, name or path the checks reject (the message "
    "names the field)",
    401: "no or a wrong bearer key (when the controller has one)",
    404: "no such adapter (or batch)",
    409: "every adapter slot is taken",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route that can answer these error codes (422 FastAPI documents itself)."""
    return {code: {"model": ErrorBody, "description": ERRORS[code]} for code in codes}


class Health(BaseModel):
    status: str


class AdapterConfigView(BaseModel):
    """An adapter's resolved config (multi_lora.config.AdapterRunConfig.to_dict)."""

    task: str
    reward: str
    rank: int
    alpha: float
    target_modules: list[str]
    lr: float
    rollout_batch_size: int
    n_samples_per_prompt: int
    save: str
    num_step: int | None
    num_epoch: int | None
    data: str
    metadata: dict[str, Any]
    agent: str | None


class AdapterStatus(AdapterConfigView):
    """One adapter as GET /adapter_runs lists it: its config, slot, progress and state."""

    name: str
    slot: int
    version: int | None  # None once completed (its slot may serve another adapter)
    step: int
    accumulated_groups: int
    registration_id: str
    state: str


class AdapterList(BaseModel):
    adapters: list[AdapterStatus]


class AdapterStates(BaseModel):
    states: dict[str, str | None]  # None: no adapter of that name


class Registered(BaseModel):
    name: str
    slot: int


class Deregistered(BaseModel):
    status: str
    name: str


class AdapterRunView(BaseModel):
    """One live adapter in GET /state (registry.AdapterRun.to_dict)."""

    name: str
    config: AdapterConfigView
    slot: int
    version: int
    step: int
    accumulated_groups: int
    registration_id: str


class RegistryState(BaseModel):
    pending: dict[str, AdapterRunView]
    active: dict[str, AdapterRunView]
    retiring: dict[str, AdapterRunView]
    cleanup: list[str]
    completed: list[str]


class Names(BaseModel):
    names: list[str]


class Slot(BaseModel):
    slot: int  # -1: the adapter was not in CLEANUP, nothing changed


class Ok(BaseModel):
    status: str


class NumStep(BaseModel):
    num_step: int


class Step(BaseModel):
    step: int
