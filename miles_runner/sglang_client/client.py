"""One async client for SGLang's HTTP protocol: real SGLang, the embedded engine, or a router in front.

Every payload is one that the pinned SGLang release (core.sglang_protocol.SGLANG_VERSION) accepts and reads in
full, checked against its own request classes by tests/sglang_client/test_wire_format.py; the fork-only fields and
routes (core.sglang_protocol.FORK_ONLY) are used only by plans for the sglang-miles fork. Optional fields are
sent only when they carry a non-default value, so older builds that lack them keep working.

Errors come back typed: `EngineError` for an HTTP error answer (either SGLang error envelope),
`EngineUnavailable` when the engine could not be reached or did not answer in time.

Abort, pause, weight and LoRA calls must go to each engine, never through the router (it does not fan them
out); `miles_runner.sglang_client.router.list_workers` gives the engine URLs behind a router.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from miles_runner.sglang_client.aiohttp_transport import AiohttpTransport, WholeResponse
from miles_runner.sglang_client.base64_json import dumps_with_base64

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
PAUSE_MODES = ("abort", "retract", "in_place")
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default group_name for the distributed weight routes


class EngineError(Exception):
    """The engine answered with an HTTP error; `message` is taken from whichever error envelope it used."""

    def __init__(self, status_code: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.body = body


class EngineUnavailable(Exception):
    """The engine could not be reached, dropped the connection, or did not answer within the timeout."""


def error_message(body: Any, fallback: str) -> str:
    """The human-readable message of an SGLang error body.

    Native routes: `{"error": {"message"}}`; OpenAI routes: `{"object": "error", "message"}`; LoRA updates:
    `{"success": false, "error_message"}`; FastAPI validation: `{"detail": [...]}`; flush_cache: plain text.
    """
    if isinstance(body, Mapping):
        nested = body.get("error")
        if isinstance(nested, Mapping) and nested.get("message"):
            return str(nested["message"])
        for key in ("message", "error_message", "detail"):
            value = body.get(key)
            if value:
                return value if isinstance(value, str) else json.dumps(value)
    if isinstance(body, str) and body.strip():
        return body.strip()
    return fallback


# Idle pooled connections are dropped before uvicorn's 5 s keep-alive timeout closes them server-side:
# reusing one the server is closing at that moment fails the request with a ReadError.
KEEPALIVE_EXPIRY_S = 2.0


def http_client(
    base_url: str,
    *,
    timeout_s: float | None,
    headers: Mapping[str, str] | None = None,
    max_connections: int = 1024,
    transport: AiohttpTransport | None = None,
) -> httpx.AsyncClient:
    """The async HTTP client of every caller of our servers and the engines: httpx's API over aiohttp's
    connection pool (aiohttp_transport.py says why), no proxy from the environment (servers are reached
    directly; a proxy would break that)."""
    return httpx.AsyncClient(
        base_url=base_url,
        headers=headers,
        timeout=httpx.Timeout(timeout_s),
        transport=transport or aiohttp_transport(max_connections),
        trust_env=False,
    )


def aiohttp_transport(max_connections: int) -> AiohttpTransport:
    return AiohttpTransport(httpx.Limits(max_connections=max_connections, keepalive_expiry=KEEPALIVE_EXPIRY_S))


def encode_json(value: Any) -> bytes:
    """A JSON body as httpx encodes `json=` (compact, UTF-8, NaN refused with a ValueError)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


class EngineClient:
    """Async client of one SGLang-protocol server at `base_url` (an engine or a router).

    `timeout_s` is the default per-call timeout (None: wait forever); paused engines hold requests until
    continue, so rollout clients want it generous. `api_key` is sent as a bearer token on every call.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        max_connections: int = 1024,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout_s = timeout_s
        self._transport = aiohttp_transport(max_connections)  # shared with `_http`: one pool of connections
        self._http = http_client(self.base_url, timeout_s=timeout_s, headers=self._headers, transport=self._transport)

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r})"

    # ---- generation ---------------------------------------------------------------------------------

    async def generate(
        self, payload: Mapping[str, Any], *, routing_key: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """POST /generate: one result dict, or a list for a batch or n > 1 (in input order)."""
        if payload.get("stream"):
            raise ValueError("generate() does not stream; use generate_stream()")
        return await self._call("POST", "/generate", json=payload, routing_key=routing_key, timeout_s=timeout_s)

    async def generate_stream(
        self, payload: Mapping[str, Any], *, routing_key: str | None = None, timeout_s: float | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """POST /generate with `stream: true`: yields each SSE event (cumulative by default) until [DONE].

        Leaving the loop early closes the connection, which makes SGLang abort the request.
        """
        async with self.stream_request(
            "POST",
            "/generate",
            json={**payload, "stream": True},
            headers=_routing_headers(routing_key),
            timeout_s=timeout_s,
        ) as response:
            if response.is_error:
                await response.aread()
                raise engine_error(response)
            async for event in _sse_events(response):
                if "error" in event:  # SGLang reports a ValueError raised mid-stream as a data event
                    raise EngineError(400, error_message(event, "stream error"), event)
                yield event

    async def chat_completions(
        self, body: Mapping[str, Any], *, routing_key: str | None = None, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """POST /v1/chat/completions (non-streaming; a proxy that streams uses `stream_request`)."""
        if body.get("stream"):
            raise ValueError("chat_completions() does not stream; use stream_request() to proxy a stream")
        return await self._call("POST", "/v1/chat/completions", json=body, routing_key=routing_key, timeout_s=timeout_s)

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        content: bytes | None = None,
        params: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        """A raw call for proxies: returns the response whatever its status; raises only EngineUnavailable."""
        with _unavailable_on_transport_error(f"{self.base_url}{path}"):
            return await self._http.request(
                method,
                path,
                json=json,
                headers=headers,
                content=content,
                params=params,
                timeout=_timeout(timeout_s),
            )

    @contextlib.asynccontextmanager
    async def stream_request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """Like `request`, but the body is read as it arrives (`aiter_lines`, `aiter_raw`): for streams.
        Transport failures, also while reading, raise EngineUnavailable."""
        with _unavailable_on_transport_error(f"{self.base_url}{path}"):
            async with self._http.stream(
                method, path, json=json, headers=headers, timeout=_timeout(timeout_s)
            ) as response:
                yield response

    # ---- abort, pause, cache --------------------------------------------------------------------------

    async def abort_request(self, rid: str = "", *, abort_all: bool = False, prefix: bool = False) -> None:
        """POST /abort_request. SGLang aborts every request whose rid starts with `rid`, but only when `rid`
        exactly matches a tracked request, unless `prefix` is set (a fork-only field: core.sglang_protocol).
        Aborted requests return to their callers with finish_reason type "abort"."""
        if not rid and not abort_all:
            raise ValueError("abort_request needs a rid or abort_all=True")
        body: dict[str, Any] = {"rid": rid, "abort_all": abort_all}
        if prefix:
            body["prefix"] = True
        await self._call("POST", "/abort_request", json=body)

    async def pause_generation(self, mode: str = "abort") -> dict[str, Any]:
        """POST /pause_generation: "abort" (in-flight requests come back aborted), "retract" (recomputed after
        continue) or "in_place" (kept with their KV). New requests are held until continue_generation."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        return await self._call("POST", "/pause_generation", json={"mode": mode})

    async def continue_generation(self) -> dict[str, Any]:
        return await self._call("POST", "/continue_generation", json={})

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """POST /release_memory_occupation: give back the memory of `tags` (kv_cache, weights, cuda_graph; None:
        all) while the trainer runs. SGLang requires the engine idle (or paused) and answers null."""
        await self._call("POST", "/release_memory_occupation", json=_tags_body(tags))

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """POST /resume_memory_occupation: take the memory of `tags` back (the weights restored before a push)."""
        await self._call("POST", "/resume_memory_occupation", json=_tags_body(tags))

    async def flush_cache(self) -> bool:
        """POST /flush_cache: True once flushed, False when the engine is busy (SGLang answers 400 while any
        request is running or waiting, including requests kept by an in-place pause)."""
        response = await self.request("POST", "/flush_cache")
        if response.status_code == 400:
            return False
        if response.is_error:
            raise engine_error(response)
        return True

    # ---- LoRA ---------------------------------------------------------------------------------------

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> dict[str, Any]:
        """POST /load_lora_adapter; returns LoRAUpdateOutput (`loaded_adapters`). A loaded name is a 400."""
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        if pinned:
            body["pinned"] = True
        return await self._call("POST", "/load_lora_adapter", json=body)

    async def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        return await self._call("POST", "/unload_lora_adapter", json={"lora_name": name})

    async def load_lora_adapter_from_tensors(
        self, name: str, config: Mapping[str, Any], serialized_named_tensors: Sequence[str], *, pinned: bool = False
    ) -> dict[str, Any]:
        """POST /load_lora_adapter_from_tensors: `config` is the PEFT adapter_config dict, and
        `serialized_named_tensors` one serialized copy of {name: tensor} per TP rank, each rank reading its own
        (engine.tensor_wire.lora_tensor_payloads makes them for either engine kind)."""
        body: dict[str, Any] = {
            "lora_name": name,
            "config_dict": dict(config),
            "serialized_named_tensors": _per_rank(serialized_named_tensors),
        }
        if pinned:
            body["pinned"] = True
        # The tensors' base64 is spliced into the JSON rather than scanned by json.dumps (sglang_client/base64_json.py).
        content = dumps_with_base64(body, "serialized_named_tensors")
        return await self._call("POST", "/load_lora_adapter_from_tensors", content=content)

    async def load_lora_adapter_from_distributed(
        self,
        name: str,
        config: Mapping[str, Any],
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        upsert: bool = False,
        pinned: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /load_lora_adapter_from_distributed, a route only the sglang-miles fork serves
        (core.sglang_protocol.FORK_ONLY): only the metadata travels here; rank 0 of `group_name` broadcasts the
        tensors, in `names` order, while this call waits. `dtypes` are names without "torch." ("bfloat16").
        `upsert` replaces a loaded adapter's weights in place (no unload)."""
        body: dict[str, Any] = {
            "lora_name": name,
            "config_dict": dict(config),
            **_tensor_metadata(names, dtypes, shapes, group_name),
            "pinned": pinned,
            "upsert": upsert,
        }
        return await self._call("POST", "/load_lora_adapter_from_distributed", json=body, timeout_s=timeout_s)

    # ---- weights ------------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self,
        model_path: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk; a failed update is a 400 (EngineError)."""
        body = _weight_update_body(weight_version, flush_cache, abort_all_requests)
        return await self._call(
            "POST",
            "/update_weights_from_disk",
            json={"model_path": str(model_path), **body},
            timeout_s=timeout_s,
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[str],
        *,
        load_format: str | None = None,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_tensor: one MultiprocessingSerializer string per TP rank."""
        body: dict[str, Any] = {
            "serialized_named_tensors": _per_rank(serialized_named_tensors),
            **_weight_update_body(weight_version, flush_cache, abort_all_requests),
        }
        if load_format is not None:
            body["load_format"] = load_format
        return await self._call("POST", "/update_weights_from_tensor", json=body, timeout_s=timeout_s)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "nccl",
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /init_weights_update_group: the engine joins `group_name` as rank `rank_offset` (plus its TP
        rank) of `world_size`; the answer comes once every rank, the trainer's included, has joined."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return await self._call("POST", "/init_weights_update_group", json=body, timeout_s=timeout_s)

    async def destroy_weights_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> dict[str, Any]:
        return await self._call("POST", "/destroy_weights_update_group", json={"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        *,
        group_name: str = DEFAULT_GROUP_NAME,
        weight_version: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """POST /update_weights_from_distributed: base weights (HF names) broadcast by rank 0 of `group_name`
        in `names` order while this call waits."""
        body = {
            **_tensor_metadata(names, dtypes, shapes, group_name),
            **_weight_update_body(weight_version, flush_cache, abort_all_requests),
        }
        return await self._call("POST", "/update_weights_from_distributed", json=body, timeout_s=timeout_s)

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> dict[str, Any]:
        # abort_all_requests is always sent: its default flipped from false to true between SGLang versions.
        return await self._call(
            "POST",
            "/update_weight_version",
            json={"new_version": version, "abort_all_requests": abort_all_requests},
        )

    # ---- health and info ----------------------------------------------------------------------------

    async def health(self) -> bool:
        return await self._answers_ok("/health")

    async def health_generate(self) -> bool:
        return await self._answers_ok("/health_generate")

    async def model_info(self) -> dict[str, Any]:
        """GET /model_info, or /get_model_info on builds that predate the new path."""
        return await self._get_with_legacy_path("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        """GET /server_info, or /get_server_info on older builds."""
        return await self._get_with_legacy_path("/server_info", "/get_server_info")

    async def weight_version(self) -> str:
        return str((await self.model_info())["weight_version"])

    async def list_models(self) -> list[dict[str, Any]]:
        """GET /v1/models: the base model card, then one card per loaded LoRA adapter."""
        return (await self._call("GET", "/v1/models"))["data"]

    async def wait_healthy(self, timeout_s: float = 120.0, *, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"{self.base_url} was not healthy within {timeout_s:g} s")
            await asyncio.sleep(poll_s)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ---- plumbing -----------------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        content: bytes | None = None,  # a body already encoded as JSON
        routing_key: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """A JSON call: the decoded answer, EngineError for an error status. It goes on the transport directly
        (AiohttpTransport.fetch says why), with the client's headers and timeouts."""
        headers = {**self._headers, **(_routing_headers(routing_key) or {})}
        if json is not None and content is None:
            content = encode_json(json)
        if content is not None:
            headers["Content-Type"] = "application/json"
        url = f"{self.base_url}{path}"
        phases = dict.fromkeys(("pool", "connect", "read"), self._timeout_s if timeout_s is None else timeout_s)
        with _unavailable_on_transport_error(url):
            response = await self._transport.fetch(method, url, headers=headers, content=content, timeout=phases)
        return _whole_body(response)

    async def _answers_ok(self, path: str) -> bool:
        try:
            return (await self.request("GET", path)).status_code == 200
        except EngineUnavailable:
            return False

    async def _get_with_legacy_path(self, path: str, legacy_path: str) -> dict[str, Any]:
        response = await self.request("GET", path)
        if response.status_code == 404:
            response = await self.request("GET", legacy_path)
        if response.is_error:
            raise engine_error(response)
        return _body(response)


@contextlib.contextmanager
def _unavailable_on_transport_error(where: str) -> Iterator[None]:
    try:
        yield
    except httpx.TimeoutException as exc:
        raise EngineUnavailable(f"{where}: timed out ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise EngineUnavailable(f"{where}: {type(exc).__name__}: {exc}") from exc


def _timeout(timeout_s: float | None) -> Any:
    return httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)


def _routing_headers(routing_key: str | None) -> dict[str, str] | None:
    return {ROUTING_KEY_HEADER: routing_key} if routing_key else None


def _tags_body(tags: Sequence[str] | None) -> dict[str, Any]:
    """SGLang's Release/ResumeMemoryOccupationReqInput: `tags` left out means every tag."""
    return {} if tags is None else {"tags": list(tags)}


def _weight_update_body(weight_version: str | None, flush_cache: bool, abort_all_requests: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"flush_cache": flush_cache, "abort_all_requests": abort_all_requests}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def _per_rank(serialized_named_tensors: Sequence[str]) -> list[str]:
    # A lone string would turn into a list of characters: SGLang's field is a list, one entry per TP rank.
    if isinstance(serialized_named_tensors, str | bytes):
        raise TypeError("serialized_named_tensors takes one serialized string per TP rank: pass a list")
    return list(serialized_named_tensors)


def _tensor_metadata(
    names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]], group_name: str
) -> dict[str, Any]:
    return {
        "names": list(names),
        "dtypes": list(dtypes),
        "shapes": [list(shape) for shape in shapes],
        "group_name": group_name,
    }


def _body(response: httpx.Response) -> Any:
    return _decoded(response.content)


def _decoded(content: bytes) -> Any:
    """A JSON body, else its text (flush_cache and some errors answer plain text), None when empty."""
    if not content:
        return None
    try:
        return json.loads(content)
    except ValueError:
        return content.decode(errors="replace")


def engine_error(response: httpx.Response) -> EngineError:
    """The typed error for an HTTP error answer (for callers of `request`)."""
    body = _body(response)
    return EngineError(response.status_code, error_message(body, response.reason_phrase), body)


def _whole_body(response: WholeResponse) -> Any:
    """The decoded body of a `fetch`ed answer, or its EngineError."""
    body = _decoded(response.content)
    if response.status >= 400:
        raise EngineError(response.status, error_message(body, response.reason), body)
    return body


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
