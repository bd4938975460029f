"""Where a session's turns go: SGLang's native /generate on the engine the session is pinned to.

Through the router a turn would lose SGLang's RL fields: sglang-router 0.3.2 rebuilds /v1/chat/completions without
`input_ids` (the engine would re-render the chat template), `return_meta_info` (no logprobs or output ids come back),
the R3 fields, `rid` and `extra_key`, and /generate without `return_routed_experts` and `routed_experts_start_len`
(sglang_client/router.py). So each session is pinned on its first turn to one engine (sglang_client/engine_pool.py:
those the router lists as healthy, else every engine the server was given; least-loaded by open sessions) and all its
turns go there as /generate, with every field SGLang reads: the prefix cache of its conversation, an in-place paused
request and the routing that R3 replays all live on that engine.

Every other session path is proxied to `entry`: the router (with the session's `X-SMG-Routing-Key`) when there
is one, else the session's own engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import EnginePool


class SessionUpstream:
    def __init__(
        self,
        url: str,
        *,
        behind_router: bool,
        api_key: str | None,
        timeout_s: float,
        engine_urls: Sequence[str] = (),
    ) -> None:
        """`url`: the router, or without one the engine; `engine_urls`: without a router, every engine the
        sessions are spread over (default: `url` alone)."""
        self.behind_router = behind_router
        self.entry = EngineClient(url, api_key=api_key, timeout_s=timeout_s)
        router = url if behind_router else None
        self.engines = EnginePool.for_deployment(router, engine_urls or [url], api_key=api_key, timeout_s=timeout_s)

    async def generate(self, session_id: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /generate on the session's engine: the native result (EngineError for an HTTP error answer,
        EngineUnavailable when no engine could be reached)."""
        engine = await self.engine(session_id)
        return cast(dict[str, Any], await engine.generate(body))  # a turn is one prompt: one result

    async def engine(self, session_id: str) -> EngineClient:
        return await self.engines.pin(session_id)

    async def proxy_target(self, session_id: str) -> EngineClient:
        """Where a non-generation session path goes: the router (it routes by the session's key), else the
        session's engine."""
        return self.entry if self.behind_router else await self.engine(session_id)

    def pinned(self, session_id: str) -> str | None:
        return self.engines.pinned(session_id)

    def release(self, session_id: str) -> None:
        self.engines.release(session_id)

    async def aclose(self) -> None:
        await self.entry.aclose()
        await self.engines.aclose()
