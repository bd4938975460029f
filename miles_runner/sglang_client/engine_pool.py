"""Which engine serves a rollout's generation: one path for single-turn groups, multi-LoRA groups and sessions.

Why not through the router: sglang-router 0.3.2 rebuilds every generation request from its own types and
drops SGLang's RL fields (sglang_client/router.py), among them `return_routed_experts` and
`routed_experts_start_len` on /generate, so routing replay (R3) would be lost. Generation therefore goes as
native /generate straight to one engine; the router stays the registry of the engines (its "workers").

The engines are those the router lists as healthy (GET /workers, asked at every pin, so an engine that was
restarted and registered again is seen), else the plan's engines. A key (a prompt group, a session) is pinned to
one engine while it lives: a group's samples share the prompt's prefix cache, a session's turns its
conversation's cache, an in-place paused request and the routing R3 replays.

The choice is least-loaded: the engine with the fewest live pins (groups in flight, sessions open). Ties go to
the engine given the fewest pins so far, so callers that pin one key at a time still alternate over every
engine (round robin) instead of always landing on the first.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from miles_runner.sglang_client.client import DEFAULT_TIMEOUT_S, EngineClient, EngineError, EngineUnavailable
from miles_runner.sglang_client.router import list_workers

EngineSource = Callable[[], Awaitable[list[str]]]
ENGINE_LIST_TIMEOUT_S = 10.0


def fixed_engines(urls: Sequence[str]) -> EngineSource:
    """The engines are known up front (the plan lists them)."""
    frozen = [url.rstrip("/") for url in urls]

    async def engines() -> list[str]:
        return list(frozen)

    return engines


def router_engines(router_url: str, *, healthy_only: bool = False, api_key: str | None = None) -> EngineSource:
    """The engines are whatever the router lists right now (`healthy_only`: those it still routes to). A router
    that cannot be asked reads as EngineUnavailable."""

    async def engines() -> list[str]:
        try:
            return await list_workers(
                router_url, timeout_s=ENGINE_LIST_TIMEOUT_S, healthy_only=healthy_only, api_key=api_key
            )
        except EngineError as error:
            raise EngineUnavailable(f"the router at {router_url} did not list its workers: {error}") from error

    return engines


class EnginePool:
    """Pins keys to engines (least-loaded, see the module doc) and holds one client per engine."""

    def __init__(
        self,
        source: EngineSource,
        *,
        where: str,
        api_key: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.where = where  # names the source in errors: "the router at URL", "the engines [...]"
        self._source = source
        self._api_key, self._timeout_s = api_key, timeout_s
        self._clients: dict[str, EngineClient] = {}
        self._pins: dict[str, str] = {}  # key -> engine URL
        self._given: Counter[str] = Counter()  # engine URL -> pins given so far (the tie-break)

    @classmethod
    def for_deployment(
        cls,
        router_url: str | None,
        engine_urls: Sequence[str],
        *,
        api_key: str | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> EnginePool:
        """The engines the router lists as healthy when there is a router, else the plan's engines."""
        if router_url:
            source = router_engines(router_url, healthy_only=True, api_key=api_key)
            where = f"the router at {router_url}"
        else:
            source, where = fixed_engines(engine_urls), f"the engines {list(engine_urls)}"
        return cls(source, where=where, api_key=api_key, timeout_s=timeout_s)

    async def pin(self, key: str) -> EngineClient:
        """The client of `key`'s engine, pinning `key` on its first call."""
        url = self._pins.get(key)
        if url is None:
            engines = await self._source()
            if not engines:
                raise EngineUnavailable(f"{self.where} lists no healthy worker")
            # A concurrent call for the same key may have pinned it while the engines were listed.
            if (url := self._pins.get(key)) is None:
                url = self._pins[key] = self._least_loaded(engines)
                self._given[url] += 1
        return self.client(url)

    def pinned(self, key: str) -> str | None:
        return self._pins.get(key)

    def release(self, key: str) -> None:
        self._pins.pop(key, None)

    @contextlib.asynccontextmanager
    async def lease(self, key: str) -> AsyncIterator[EngineClient]:
        """`key` pinned for the duration of the block (a prompt group in flight)."""
        try:
            yield await self.pin(key)
        finally:
            self.release(key)

    def client(self, url: str) -> EngineClient:
        if url not in self._clients:
            self._clients[url] = EngineClient(url, api_key=self._api_key, timeout_s=self._timeout_s)
        return self._clients[url]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    async def __aenter__(self) -> EnginePool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _least_loaded(self, engines: list[str]) -> str:
        live = Counter(self._pins.values())
        return min(sorted(engines), key=lambda url: (live[url], self._given[url]))
