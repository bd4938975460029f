"""SGLang's own request definitions at the pinned release, read from its wheel's source with `ast`.

Nothing of SGLang is imported (its modules import CUDA kernels): the wheel that `make sglang-spec` downloads
(`<cache>/sglang-<version>/`) is opened as a zip and three kinds of file are parsed:

- `srt/entrypoints/http_server.py`: each route (`@app.post`, `@app.api_route` ...), its methods, and the class
  of its body parameter, with whether the body may be left out (the parameter has a default);
- the body classes: `srt/managers/io_struct.py` (msgspec structs, and dataclasses such as GenerateReqInput) and
  `srt/entrypoints/openai/protocol.py` (pydantic models): each field, whether it has a default, its annotation;
- `/generate`'s contract gate: the route also decodes the body with `api/v1/api_types.py` (found through
  `srt/entrypoints/api_contract.py`), whose structs say whether they reject unknown keys.

How SGLang treats a key it does not define is read from the same source: msgspec structs are validated through
`msgspec_struct_pydantic_core_schema` (`srt/utils/msgspec_utils.py`, `extra_behavior="ignore"` at 0.5.23),
pydantic models by their `model_config` (pydantic's default is to ignore), dataclasses as pydantic does
(ignore), and the gate's structs by their generated docstring ("unknown keys rejected" or "... ignored").
"""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from miles_runner.core.paths import cache_dir
from miles_runner.core.sglang_protocol import SGLANG_VERSION

IO_STRUCT = "sglang/srt/managers/io_struct.py"
PROTOCOL = "sglang/srt/entrypoints/openai/protocol.py"
HTTP_SERVER = "sglang/srt/entrypoints/http_server.py"
MSGSPEC_UTILS = "sglang/srt/utils/msgspec_utils.py"
API_CONTRACT = "sglang/srt/entrypoints/api_contract.py"
API_TYPES = "sglang/api/v1/api_types.py"
_SOURCES = (IO_STRUCT, PROTOCOL, HTTP_SERVER, MSGSPEC_UTILS, API_CONTRACT, API_TYPES)

IGNORED, REFUSED = "ignored", "refused"  # what SGLang does with a key its definition lacks
ANY = None  # an annotation that admits any JSON value
ROUTE_DECORATORS = {"post": ("POST",), "put": ("PUT",), "get": ("GET",), "delete": ("DELETE",)}
SCALAR_KINDS = {
    "str": {"str"},
    "int": {"int"},
    "float": {"int", "float"},
    "bool": {"bool"},
    "None": {"null"},
    # Base64Bytes: an HTTP body carries bytes as base64 text
    "bytes": {"str"},
    "dict": {"object"},
    "Dict": {"object"},
    "list": {"array"},
    "List": {"array"},
    "tuple": {"array"},
    "Tuple": {"array"},
    "set": {"array"},
    "Set": {"array"},
}
WRAPPERS = {"Optional", "Union", "Annotated", "Literal"}


class SpecMissing(RuntimeError):
    """The pinned SGLang wheel is not in the cache: `make sglang-spec` downloads it."""


@dataclass(frozen=True)
class FieldDef:
    name: str
    required: bool
    annotation: str  # as written in SGLang's source
    kinds: frozenset[str] | None  # JSON kinds it admits (str, int, float, bool, null, array, object); None: any
    literals: tuple[Any, ...] | None = None  # the values of a Literal[...] annotation
    nested: str | None = None  # a struct of the same module a JSON object here is decoded as


@dataclass(frozen=True)
class RequestDef:
    name: str
    module: str
    fields: dict[str, FieldDef]
    unknown_keys: str  # IGNORED or REFUSED
    nulls_allowed: bool = False  # the gate's decoders treat null as "unset" for every field


@dataclass(frozen=True)
class RouteDef:
    path: str
    methods: tuple[str, ...]
    body: RequestDef | None  # None: the route reads no JSON body
    body_required: bool
    gate: RequestDef | None = None  # a second decode that refuses what it does not accept (/generate)
    gate_structs: dict[str, RequestDef] = field(default_factory=dict)  # the gate's nested structs by name


@dataclass(frozen=True)
class SGLangSpec:
    version: str
    routes: dict[str, RouteDef]


def pinned_wheel_dir() -> Path:
    return cache_dir() / f"sglang-{SGLANG_VERSION}"


def pinned_wheel() -> Path:
    wheels = sorted(pinned_wheel_dir().glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not wheels:
        raise SpecMissing(f"no sglang-{SGLANG_VERSION} wheel in {pinned_wheel_dir()}; run `make sglang-spec`")
    return wheels[0]


@cache
def load_spec(wheel: Path) -> SGLangSpec:
    with zipfile.ZipFile(wheel) as archive:
        source = {name: archive.read(name).decode() for name in _SOURCES if name in archive.namelist()}
    version = wheel.name.split("-")[1]
    return SGLangSpec(version, _routes(source))


# ---- routes ------------------------------------------------------------------------------------------------


def _routes(source: dict[str, str]) -> dict[str, RouteDef]:
    bodies = {
        **_module_requests(source[IO_STRUCT], IO_STRUCT, _msgspec_policy(source[MSGSPEC_UTILS])),
        **_module_requests(source[PROTOCOL], PROTOCOL, IGNORED),
    }
    gate, gate_structs = _generate_gate(source)
    routes: dict[str, RouteDef] = {}
    for fn in ast.walk(ast.parse(source[HTTP_SERVER])):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for path, methods in _route_decorators(fn):
            body, required = _body_parameter(fn, bodies)
            gated = gate if _calls(fn, "generate_contract_error") else None
            routes[path] = RouteDef(path, methods, body, required, gated, gate_structs if gated else {})
    return routes


def _route_decorators(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[str, tuple[str, ...]]]:
    for decorator in fn.decorator_list:
        if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
            continue
        if not (isinstance(decorator.func.value, ast.Name) and decorator.func.value.id == "app"):
            continue
        if not (decorator.args and isinstance(decorator.args[0], ast.Constant)):
            continue  # a path read from the environment (Ollama, SageMaker routes)
        path, verb = decorator.args[0].value, decorator.func.attr
        if verb == "api_route":
            methods = next((ast.literal_eval(k.value) for k in decorator.keywords if k.arg == "methods"), ["GET"])
            yield path, tuple(methods)
        elif verb in ROUTE_DECORATORS:
            yield path, ROUTE_DECORATORS[verb]


def _body_parameter(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, bodies: dict[str, RequestDef]
) -> tuple[RequestDef | None, bool]:
    """The parameter annotated with a request class: (its definition, whether a body must be sent)."""
    args = fn.args.args
    defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
    for arg, default in zip(args, defaults, strict=True):
        names = [n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)] if arg.annotation else []
        found = [bodies[name] for name in names if name in bodies]
        if found:
            return found[0], default is None
    return None, False


def _calls(fn: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name for n in ast.walk(fn))


# ---- request classes ----------------------------------------------------------------------------------------


def _msgspec_policy(msgspec_utils: str) -> str:
    """How the msgspec-to-pydantic bridge treats unknown keys (its typed_dict_schema's extra_behavior)."""
    for node in ast.walk(ast.parse(msgspec_utils)):
        if isinstance(node, ast.keyword) and node.arg == "extra_behavior" and isinstance(node.value, ast.Constant):
            return REFUSED if node.value.value == "forbid" else IGNORED
    return IGNORED


def _module_requests(text: str, module: str, default_policy: str) -> dict[str, RequestDef]:
    tree = ast.parse(text)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    aliases = _aliases(tree)
    return {
        # A dataclass body is validated by pydantic, which ignores unknown keys of a dataclass.
        name: _request_def(name, classes, aliases, module, IGNORED if _is_dataclass(cls) else default_policy)
        for name, cls in classes.items()
    }


def _is_dataclass(cls: ast.ClassDef) -> bool:
    return any(ast.unparse(d).split("(")[0].endswith("dataclass") for d in cls.decorator_list)


Classes = dict[str, ast.ClassDef]
Aliases = dict[str, ast.expr]
Shape = tuple[frozenset[str] | None, tuple[Any, ...] | None, str | None]  # JSON kinds, Literal values, struct


def _request_def(name: str, classes: Classes, aliases: Aliases, module: str, default_policy: str) -> RequestDef:
    fields: dict[str, FieldDef] = {}
    policy = default_policy
    for cls in reversed(list(_lineage(classes[name], classes))):  # bases first: a subclass overrides
        for node in cls.body:
            if _is_field(node):
                fields[node.target.id] = _field_def(node, aliases, classes)
            policy = _model_config_policy(node) or policy
    return RequestDef(name, module, fields, policy)


def _is_field(node: ast.stmt) -> bool:
    """An annotated class attribute that is a field (not private, not a ClassVar)."""
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
        return False
    return not node.target.id.startswith("_") and "ClassVar" not in ast.unparse(node.annotation)


def _lineage(cls: ast.ClassDef, classes: Classes) -> Iterator[ast.ClassDef]:
    yield cls
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            yield from _lineage(classes[base.id], classes)


def _model_config_policy(node: ast.stmt) -> str | None:
    """`model_config = ConfigDict(extra=...)` of a pydantic model."""
    if not (
        isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "model_config" for t in node.targets)
    ):
        return None
    for keyword in getattr(node.value, "keywords", []):
        if keyword.arg == "extra" and isinstance(keyword.value, ast.Constant):
            return REFUSED if keyword.value.value == "forbid" else IGNORED
    return None


def _field_def(node: ast.AnnAssign, aliases: Aliases, classes: Classes) -> FieldDef:
    kinds, literals, nested = _shape(node.annotation, aliases, classes)
    return FieldDef(node.target.id, not _has_default(node.value), ast.unparse(node.annotation), kinds, literals, nested)


def _has_default(value: ast.expr | None) -> bool:
    """A value, or `field(default=...)` / `Field(default ...)` / `msgspec.field(default_factory=...)`."""
    if value is None:
        return False
    if isinstance(value, ast.Call) and _call_name(value) in ("field", "Field"):
        if any(k.arg in ("default", "default_factory") for k in value.keywords):
            return True
        first = value.args[0] if value.args else None
        return first is not None and not (isinstance(first, ast.Constant) and first.value is Ellipsis)
    return True


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _aliases(tree: ast.Module) -> Aliases:
    """Module-level type aliases: `StringOrList = Union[str, StringList]`."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        single = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        if single and isinstance(node.value, ast.Subscript | ast.Name | ast.BinOp):
            out[node.targets[0].id] = node.value
    return out


# ---- annotations -> JSON shapes ------------------------------------------------------------------------------


def _shape(annotation: ast.expr, aliases: Aliases, classes: Classes, depth: int = 0) -> Shape:
    """(JSON kinds, Literal values, nested struct name) an annotation admits; kinds None means any."""
    if depth > 12:
        return ANY, None, None
    if isinstance(annotation, ast.Constant):
        if annotation.value is None:
            return frozenset({"null"}), None, None
        if isinstance(annotation.value, str):  # a forward reference
            return _shape(ast.parse(annotation.value, mode="eval").body, aliases, classes, depth + 1)
        return ANY, None, None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _union([annotation.left, annotation.right], aliases, classes, depth)
    if isinstance(annotation, ast.Attribute):
        return ANY, None, None
    if isinstance(annotation, ast.Name):
        return _named_shape(annotation.id, aliases, classes, depth)
    if isinstance(annotation, ast.Subscript):
        return _subscript_shape(annotation, aliases, classes, depth)
    return ANY, None, None


def _named_shape(name: str, aliases: Aliases, classes: Classes, depth: int) -> Shape:
    if name in SCALAR_KINDS:
        return frozenset(SCALAR_KINDS[name]), None, None
    if name in aliases:
        return _shape(aliases[name], aliases, classes, depth + 1)
    if name in classes:
        return frozenset({"object"}), None, name
    return ANY, None, None  # Any, an imported or enum type: not checked


def _subscript_shape(annotation: ast.Subscript, aliases: Aliases, classes: Classes, depth: int) -> Shape:
    outer = annotation.value.id if isinstance(annotation.value, ast.Name) else ""
    items = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
    if outer == "Optional":
        return _union([items[0], ast.Constant(None)], aliases, classes, depth)
    if outer == "Union":
        return _union(items, aliases, classes, depth)
    if outer == "Annotated":
        return _shape(items[0], aliases, classes, depth + 1)
    if outer == "Literal":
        values = tuple(ast.literal_eval(item) for item in items)
        return frozenset(json_kind(v) for v in values), values, None
    if outer in SCALAR_KINDS:
        return frozenset(SCALAR_KINDS[outer]), None, _list_item_struct(outer, items, aliases, classes, depth)
    return ANY, None, None


def _list_item_struct(outer: str, items: list[ast.expr], aliases: Aliases, classes: Classes, depth: int) -> str | None:
    if outer in ("List", "list") and items:
        return _shape(items[0], aliases, classes, depth + 1)[2]
    return None


def _union(items: list[ast.expr], aliases: Aliases, classes: Classes, depth: int) -> Shape:
    """Kinds of every member (Literal values are not kept across a union: only the kinds are checked)."""
    kinds: set[str] = set()
    nested = None
    for item in items:
        item_kinds, _, item_nested = _shape(item, aliases, classes, depth + 1)
        if item_kinds is ANY:
            return ANY, None, None
        kinds |= item_kinds
        nested = nested or item_nested
    return frozenset(kinds), None, nested


def json_kind(value: Any) -> str:
    """The JSON kind of a decoded JSON value, in the names FieldDef.kinds uses."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "array" if isinstance(value, list | tuple) else "object"


# ---- /generate's contract gate --------------------------------------------------------------------------------


def _generate_gate(source: dict[str, str]) -> tuple[RequestDef | None, dict[str, RequestDef]]:
    """The api_types struct `generate_contract_error` decodes a /generate body with, and its nested structs."""
    if API_CONTRACT not in source or API_TYPES not in source:
        return None, {}
    decoded = [
        n.func.value.id
        for n in ast.walk(ast.parse(source[API_CONTRACT]))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "from_json_value"
        and isinstance(n.func.value, ast.Name)
    ]
    structs = _api_structs(source[API_TYPES])
    return (structs.get(decoded[0]) if decoded else None), structs


def _api_structs(text: str) -> dict[str, RequestDef]:
    tree = ast.parse(text)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    aliases = _aliases(tree)
    structs = {}
    for name, cls in classes.items():
        doc = ast.get_docstring(cls) or ""
        policy = REFUSED if "unknown keys rejected" in doc else IGNORED
        fields = {n.target.id: _field_def(n, aliases, classes) for n in cls.body if _is_field(n)}
        structs[name] = RequestDef(name, API_TYPES, fields, policy, nulls_allowed=True)
    return structs
