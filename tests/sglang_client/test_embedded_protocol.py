"""The embedded engine takes the pinned SGLang's request bodies: its routes, fields, required fields and JSON
shapes are checked against SGLang's own definitions (read from the wheel), and over HTTP it refuses and accepts
what SGLang refuses and accepts. Served as stock SGLang (`--engine-build stock`), it has no fork-only feature.
"""

from __future__ import annotations

import json
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from fastapi.routing import APIRoute
from pydantic import BaseModel

from miles_runner.core.sglang_protocol import LORA_BROADCAST_ROUTE, MILES_FORK, STOCK, fork_only_fields
from miles_runner.embedded_engine.protocol import NOT_IMPLEMENTED_SAMPLING_KEYS, SamplingParams
from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.tensor_wire import serialize_lora_tensors, tensor_checksum
from miles_testkit.contract import CONTRACT_ADAPTER, ContractTarget, contract_engine_argv
from miles_testkit.contract.abort_pause import abort_by_prefix_aborts_every_match
from miles_testkit.launch import engine_url, start_engine

from .engines import EMBEDDED, ENGINE_START_TIMEOUT_S, TEST_ENV
from .test_contract import EMBEDDED_LONG_TOKENS

pytestmark = pytest.mark.integration


@dataclass(frozen=True)
class EmbeddedRoute:
    methods: frozenset[str]
    body: type[BaseModel] | None
    body_required: bool


def _routes(app) -> dict[str, EmbeddedRoute]:
    routes = {}
    for route in app.routes:
        if isinstance(route, APIRoute):
            [*params] = route.dependant.body_params
            body = params[0].field_info if params else None
            model, required = (body.annotation, body.is_required()) if body else (None, False)
            if body is None and hasattr(route.endpoint, "body_model"):  # a route that validates its body itself
                model, required = route.endpoint.body_model, True
            routes[_path(route.path)] = EmbeddedRoute(frozenset(route.methods), model, required)
    return routes


def _path(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)  # /v1/models/{model_id:path} and SGLang's {model:path} alike


@pytest.fixture(scope="module")
def embedded_engine(tiny_moe_dir: Path):
    """The engine object the server runs (never started here: only its routes are read)."""
    from miles_runner.embedded_engine.args import parse_args
    from miles_runner.embedded_engine.engine import EmbeddedEngine

    return EmbeddedEngine(parse_args(["--model-path", str(tiny_moe_dir), "--enable-lora"]))


@pytest.fixture(scope="module")
def embedded_routes(embedded_engine) -> dict[str, EmbeddedRoute]:
    from miles_runner.embedded_engine.app import create_app

    return _routes(create_app(embedded_engine))


@pytest.fixture(scope="module")
def sglang_routes(sglang_spec):
    return {_path(path): route for path, route in sglang_spec.routes.items()}


def _shared(embedded_routes, sglang_routes):
    return [(path, route, sglang_routes[path]) for path, route in embedded_routes.items() if path in sglang_routes]


def test_every_embedded_route_is_an_sglang_route_or_the_listed_fork_route(embedded_routes, sglang_routes):
    assert set(embedded_routes) - set(sglang_routes) == {LORA_BROADCAST_ROUTE}


def test_embedded_routes_take_the_methods_sglang_takes(embedded_routes, sglang_routes):
    differ = {
        p: (sorted(e.methods), s.methods)
        for p, e, s in _shared(embedded_routes, sglang_routes)
        if e.methods != set(s.methods)
    }
    assert differ == {}


def test_embedded_routes_need_a_body_exactly_where_sglang_does(embedded_routes, sglang_routes):
    differ = {
        p: (e.body_required, s.body_required)
        for p, e, s in _shared(embedded_routes, sglang_routes)
        if e.body_required != s.body_required
    }
    assert differ == {}


def test_embedded_bodies_define_only_sglang_fields_or_listed_fork_fields(embedded_routes, sglang_routes):
    extra = {}
    for path, embedded, sglang in _shared(embedded_routes, sglang_routes):
        if embedded.body is not None:
            own = set(embedded.body.model_fields) - set(sglang.body.fields) - fork_only_fields(path)
            if own:
                extra[path] = sorted(own)
    assert extra == {}


def test_embedded_bodies_require_exactly_the_fields_sglang_requires(embedded_routes, sglang_routes):
    differ = {}
    for path, embedded, sglang in _shared(embedded_routes, sglang_routes):
        if embedded.body is not None:
            ours = {name for name, field in embedded.body.model_fields.items() if field.is_required()}
            theirs = {name for name, field in sglang.body.fields.items() if field.required}
            if ours != theirs:
                differ[path] = (sorted(ours), sorted(theirs))
    assert differ == {}


def test_embedded_fields_accept_no_json_shape_sglang_refuses(embedded_routes, sglang_routes):
    wider = {}
    for path, embedded, sglang in _shared(embedded_routes, sglang_routes):
        for name, field in (embedded.body.model_fields if embedded.body else {}).items():
            difference = _shape_difference(field.annotation, sglang.body.fields.get(name))
            if difference:
                wider[f"{path} {name}"] = difference
    assert wider == {}


def _shape_difference(annotation: Any, theirs) -> tuple | None:
    """What the embedded field accepts beyond SGLang's: JSON kinds, or Literal values; None when nothing."""
    if theirs is None:
        return None
    ours = _json_kinds(annotation)
    if theirs.kinds is not None and ours is not None and not ours <= theirs.kinds:
        return sorted(ours), sorted(theirs.kinds)
    if theirs.literals is not None and _literals(annotation) != set(theirs.literals):
        return _literals(annotation), theirs.literals
    return None


def test_embedded_sampling_params_are_sglangs_less_the_refused_ones(sglang_spec):
    theirs = set(sglang_spec.routes["/generate"].gate_structs["SamplingParams"].fields)
    assert set(SamplingParams.model_fields) | set(NOT_IMPLEMENTED_SAMPLING_KEYS) == theirs
    assert not set(SamplingParams.model_fields) & set(NOT_IMPLEMENTED_SAMPLING_KEYS)


def test_an_engine_serving_as_stock_sglang_has_no_fork_route(embedded_engine):
    from miles_runner.embedded_engine.app import create_app

    assert embedded_engine.args.engine_build == MILES_FORK
    embedded_engine.args.engine_build = STOCK
    try:
        assert LORA_BROADCAST_ROUTE not in _routes(create_app(embedded_engine))
    finally:
        embedded_engine.args.engine_build = MILES_FORK


def _json_kinds(annotation: Any) -> set[str] | None:
    """The JSON kinds a pydantic annotation admits (None: any), named as sglang_spec names them."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kinds = [_json_kinds(arg) for arg in args]
        return None if None in kinds else set().union(*kinds)
    if origin is Literal:
        return {"null" if v is None else "str" if isinstance(v, str) else "bool" for v in args}
    scalar = {
        type(None): {"null"},
        str: {"str"},
        bool: {"bool"},
        int: {"int"},
        float: {"int", "float"},
        list: {"array"},
        dict: {"object"},
    }
    base = origin or annotation
    if base in scalar:
        return scalar[base]
    if isinstance(base, type) and issubclass(base, BaseModel):
        return {"object"}
    return None


def _literals(annotation: Any) -> set[Any] | None:
    return set(typing.get_args(annotation)) if typing.get_origin(annotation) is Literal else None


# ---- over HTTP: what SGLang refuses is a 400, what it accepts is served --------------------------------------


@pytest.fixture
async def http(contract_engine_url: str):
    async with httpx.AsyncClient(base_url=contract_engine_url, timeout=60, trust_env=False) as client:
        yield client


async def test_an_unknown_top_level_field_is_ignored_as_sglang_ignores_it(http):
    reply = await http.post("/update_weight_version", json={"new_version": "default", "some_new_field": 1})
    assert reply.status_code == 200, reply.text


async def test_an_unknown_sampling_key_is_a_400_naming_it(http):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "top_kk": 5}}
    reply = await http.post("/generate", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "sampling_params.top_kk: Extra inputs are not permitted"


async def test_an_sglang_sampling_key_the_engine_does_not_implement_is_a_400_naming_it(http):
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "stop_regex": "x+"}}
    reply = await http.post("/generate", json=body)
    assert reply.status_code == 400 and "stop_regex" in reply.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/abort_request", "/pause_generation", "/continue_generation"])
async def test_a_control_route_without_a_body_is_a_400_as_in_sglang(http, path):
    assert (await http.post(path)).status_code == 400


async def test_lora_tensors_as_one_string_instead_of_a_list_per_rank_is_a_400_naming_the_field(http, contract_adapter):
    config, tensors = _adapter(contract_adapter)
    body = {
        "lora_name": "one_string",
        "config_dict": config,
        "serialized_named_tensors": serialize_lora_tensors(tensors),
    }
    reply = await http.post("/load_lora_adapter_from_tensors", json=body)
    assert reply.status_code == 400 and "serialized_named_tensors" in reply.json()["error"]["message"]


async def test_lora_tensors_load_when_their_checksums_match_and_are_refused_when_not(http, contract_adapter):
    config, tensors = _adapter(contract_adapter)
    checksums = {name: tensor_checksum(tensor) for name, tensor in tensors.items()}
    wrong = {**checksums, next(iter(checksums)): "0" * 64}
    refused = await http.post("/load_lora_adapter_from_tensors", json=_tensors_body("bad", config, tensors, wrong))
    assert refused.status_code == 400 and "1 differ" in refused.json()["error_message"]
    loaded = await http.post("/load_lora_adapter_from_tensors", json=_tensors_body("good", config, tensors, checksums))
    assert loaded.status_code == 200, loaded.text
    await http.post("/unload_lora_adapter", json={"lora_name": "good"})


def _tensors_body(name: str, config: dict, tensors: dict, checksums: dict) -> dict:
    return {
        "lora_name": name,
        "config_dict": config,
        "serialized_named_tensors": [serialize_lora_tensors(tensors)],
        "expected_checksums": checksums,
    }


def _adapter(path: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return json.loads((path / "adapter_config.json").read_text()), load_file(str(path / "adapter_model.safetensors"))


# ---- served as stock SGLang -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stock_engine_url(tiny_moe_dir, contract_adapter, tmp_path_factory):
    port = free_port()
    argv = [*contract_engine_argv(EMBEDDED, tiny_moe_dir, port, contract_adapter), "--engine-build", STOCK]
    log_path = tmp_path_factory.mktemp("logs") / "stock_engine.log"
    engine = start_engine(argv, port=port, log_path=log_path, env=TEST_ENV, timeout_s=ENGINE_START_TIMEOUT_S)
    yield engine_url(argv, port)
    engine.stop()


async def test_served_as_stock_the_fork_route_is_a_404_and_the_prefix_field_is_dropped(
    stock_engine_url, tiny_moe_dir, contract_adapter
):
    async with EngineClient(stock_engine_url, timeout_s=120) as client:
        assert (await client.request("POST", LORA_BROADCAST_ROUTE, json={})).status_code == 404
        target = ContractTarget(
            client,
            tiny_moe_dir,
            CONTRACT_ADAPTER,
            contract_adapter,
            lora_wire=serialize_lora_tensors,
            weights_wire=serialize_lora_tensors,
            long_tokens=EMBEDDED_LONG_TOKENS,
            build=STOCK,
        )
        facts = await abort_by_prefix_aborts_every_match(target)
    assert facts == {"prefix": "dropped (stock)"}
