"""Check a request body the project sends against the pinned SGLang's own definition of its route.

How strict, and why. Real SGLang 0.5.23 answers 400 for: a missing body on a route that takes one, a missing
required field, a value of the wrong JSON type (e.g. one string where the definition is a list), a value outside
a Literal, and, on /generate only, an unknown `sampling_params` key (its contract gate refuses it). For an unknown
top-level key it answers 200 and drops the key: native bodies are parsed as `extra_behavior="ignore"` typed
dicts, OpenAI bodies by pydantic models that ignore extras. Each problem says which of the two SGLang does
(`sglang_refuses`). The tests fail on both: a dropped key is a setting accepted and silently not honoured.

Features of the sglang-miles fork (miles_runner/core/sglang_protocol.py: FORK_ONLY) pass when the plan's engine
build is the fork, and are problems on a stock build: their route is a 404 there, their field is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from miles_runner.core.sglang_protocol import MILES_FORK, STOCK, fork_only_fields, fork_only_route
from miles_testkit.contract.sglang_spec import REFUSED, FieldDef, RequestDef, RouteDef, SGLangSpec, json_kind


@dataclass(frozen=True)
class WireProblem:
    route: str
    field: str  # dotted path into the body; "" for the body itself
    problem: str
    sglang_refuses: bool  # True: SGLang answers 400 (or 404); False: it accepts the request and drops the field

    def __str__(self) -> str:
        effect = "SGLang refuses it" if self.sglang_refuses else "SGLang drops it silently"
        where = f"{self.route} {self.field}".strip()
        return f"{where}: {self.problem} ({effect})"


@dataclass(frozen=True)
class SentRequest:
    method: str
    path: str
    body: Any  # the decoded JSON body; None when none was sent


def check_request(spec: SGLangSpec, sent: SentRequest, build: str = STOCK) -> list[WireProblem]:
    path = sent.path.split("?", 1)[0]
    route = spec.routes.get(path)
    if route is None:
        return _check_unrouted(spec, path, sent.body, build)
    if sent.method not in route.methods:
        return [
            WireProblem(path, "", f"SGLang {spec.version} serves {path} for {route.methods}, not {sent.method}", True)
        ]
    return _check_routed(route, sent.body, build)


def check_requests(spec: SGLangSpec, sent: Iterable[SentRequest], build: str = STOCK) -> list[WireProblem]:
    return [problem for request in sent for problem in check_request(spec, request, build)]


def _check_unrouted(spec: SGLangSpec, path: str, body: Any, build: str) -> list[WireProblem]:
    if not fork_only_route(path):
        return [WireProblem(path, "", f"SGLang {spec.version} has no such route (404)", True)]
    if build != MILES_FORK:
        return [WireProblem(path, "", "a route only the sglang-miles fork serves; stock SGLang answers 404", True)]
    allowed = fork_only_fields(path)
    keys = body if isinstance(body, dict) else {}
    return [WireProblem(path, key, "not a field of the fork's request", True) for key in keys if key not in allowed]


def _check_routed(route: RouteDef, body: Any, build: str) -> list[WireProblem]:
    if route.body is None:
        return [] if body is None else [WireProblem(route.path, "", "a body on a route that reads none", False)]
    if body is None:
        return [WireProblem(route.path, "", "no body; the route requires one", True)] if route.body_required else []
    problems = _check_object(route.path, "", route.body, body, {}, build)
    if route.gate is not None:  # /generate: its contract gate must admit the body too, refusals only
        gate_problems = _check_object(route.path, "", route.gate, body, route.gate_structs, build)
        problems += [p for p in gate_problems if p.sglang_refuses and p not in problems]
    return problems


def _check_object(
    route: str, prefix: str, definition: RequestDef, body: Any, structs: dict[str, RequestDef], build: str
) -> list[WireProblem]:
    if not isinstance(body, dict):
        return [WireProblem(route, prefix, f"a JSON {json_kind(body)} where {definition.name} is an object", True)]
    problems = [
        WireProblem(route, _join(prefix, name), f"required by {definition.name} and missing", True)
        for name, field in definition.fields.items()
        if field.required and name not in body
    ]
    for key, value in body.items():
        path = _join(prefix, key)
        field = definition.fields.get(key)
        if field is None:
            problems += _unknown_key(route, path, key, definition, build)
        elif not (value is None and definition.nulls_allowed):
            problems += _check_value(route, path, field, value, structs, build)
    return problems


def _unknown_key(route: str, path: str, key: str, definition: RequestDef, build: str) -> list[WireProblem]:
    refused = definition.unknown_keys == REFUSED
    if "." not in path and key in fork_only_fields(route):
        problem = "a field only the sglang-miles fork reads"
        return [] if build == MILES_FORK else [WireProblem(route, path, problem, refused)]
    return [WireProblem(route, path, f"not a field of {definition.name}", refused)]


def _check_value(
    route: str, path: str, field: FieldDef, value: Any, structs: dict[str, RequestDef], build: str
) -> list[WireProblem]:
    kind = json_kind(value)
    if field.kinds is not None and kind not in field.kinds:
        expected = " or ".join(sorted(field.kinds))
        return [WireProblem(route, path, f"a JSON {kind} where `{field.annotation}` takes {expected}", True)]
    if field.literals is not None and value not in field.literals:
        return [WireProblem(route, path, f"{value!r} is not one of {field.literals}", True)]
    nested = structs.get(field.nested or "")
    if nested is None:
        return []
    items = [item for item in (value if isinstance(value, list) else [value]) if isinstance(item, dict)]
    return [p for item in items for p in _check_object(route, path, nested, item, structs, build)]


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key
