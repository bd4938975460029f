"""The real `sglang-router` (sglang-router 0.3.2 from PyPI; runs on CPU) in front of N engines.

Policies of 0.3.2: random, round_robin, cache_aware (default), power_of_two, and manual, which keeps every
request carrying the same `X-SMG-Routing-Key` header on one worker (new keys are assigned per
`--assignment-mode`, random by default; requests without the header go to a random worker). 0.3.2 has no
consistent-hashing policy on its command line.

The router does not fan out abort, pause, weight or LoRA calls: send those to each engine from
`list_workers`.

It rebuilds the body of every generation request from its own request types (sglang-router 0.3.2,
`route_typed_request` in sgl-router; docs/sglang-protocol.md §9.4), so fields those types lack never reach the engine:
/generate drops `return_routed_experts`, `routed_experts_start_len` and `return_prompt_token_ids`;
/v1/chat/completions also drops `input_ids`, `return_meta_info`, `rid` and `extra_key` and sends
`skip_special_tokens: true`. Replies pass through unchanged. This is why the session server sends its turns
to the workers themselves (session/upstream.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx

from miles_runner.plan import render
from miles_runner.procs.process import ManagedProcess
from miles_runner.sglang_client.client import EngineClient, engine_error

ROUTER_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two", "manual")
STICKY_POLICY = "manual"


def router_argv(
    host: str,
    port: int,
    worker_urls: Sequence[str],
    policy: str = "cache_aware",
    extra: Sequence[str] = (),
    *,
    metrics_port: int,
    executable: str = "sglang-router",
) -> list[str]:
    """The router's command line. Its Prometheus exporter (on by default, 0.0.0.0:29000) is bound to `host`
    on `metrics_port`, so that several routers can run on one machine and nothing listens beyond `host`."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"sglang-router 0.3.2 policies are {ROUTER_POLICIES}, got {policy!r}")
    if not worker_urls:
        raise ValueError("the router needs at least one worker URL")
    argv = render.router_argv(host, port, policy, list(worker_urls), metrics_port=metrics_port)
    return [executable, *argv[1:], *extra]


def wait_for_workers(
    router: ManagedProcess, router_url: str, worker_urls: Sequence[str], timeout_s: float, *, api_key: str | None = None
) -> None:
    """Block until the router lists every one of `worker_urls`; else stop it and raise ProcessStartError.

    The router answers /health at once and silently leaves out a worker it could not reach at start."""
    expected = {worker.rstrip("/") for worker in worker_urls}
    deadline = time.monotonic() + timeout_s
    with _router_http(router_url, api_key) as http:
        while (registered := set(_registered_workers(http))) != expected:
            if not router.alive or time.monotonic() >= deadline:
                missing = sorted(expected - registered)
                raise router.start_failed(f"did not register workers {missing} within {timeout_s:g} s")
            time.sleep(0.2)


def ensure_worker(router_url: str, worker_url: str, timeout_s: float, *, api_key: str | None = None) -> None:
    """Register `worker_url` again (POST /workers) unless the router still lists it, then wait until it does:
    a router drops a worker that failed its health checks, e.g. an engine that died and was restarted."""
    worker = worker_url.rstrip("/")
    deadline = time.monotonic() + timeout_s
    with _router_http(router_url, api_key) as http:
        if worker not in _registered_workers(http):
            http.post("/workers", json={"url": worker, "worker_type": "regular"})
        while worker not in _registered_workers(http):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the router at {router_url} did not list {worker} within {timeout_s:g} s")
            time.sleep(0.2)


def worker_urls_of(body: Any, *, healthy_only: bool = False) -> list[str]:
    """Worker URLs from GET /workers (`{"workers": [{"url", "is_healthy"}]}`) or legacy GET /list_workers
    (`{"urls"}`, which reports no health)."""
    if "workers" in body:
        workers = [w for w in body["workers"] if w.get("is_healthy", True) or not healthy_only]
        return [worker["url"].rstrip("/") for worker in workers]
    return [url.rstrip("/") for url in body["urls"]]


async def list_workers(
    router_url: str, *, timeout_s: float = 10.0, healthy_only: bool = False, api_key: str | None = None
) -> list[str]:
    """The engine URLs behind a router: GET /workers, or /list_workers on routers that predate it;
    `healthy_only` leaves out the workers the router marks unhealthy (it stops routing to them)."""
    async with EngineClient(router_url, api_key=api_key, timeout_s=timeout_s) as router:
        response = await router.request("GET", "/workers")
        if response.status_code == 404:
            response = await router.request("GET", "/list_workers")
        if response.is_error:
            raise engine_error(response)
        return worker_urls_of(response.json(), healthy_only=healthy_only)


def _router_http(router_url: str, api_key: str | None) -> httpx.Client:
    """A router started with the run's key (--api-key) requires it on every route but /health."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return httpx.Client(base_url=router_url, timeout=5.0, headers=headers, trust_env=False)


def _registered_workers(http: httpx.Client) -> list[str]:
    try:
        response = http.get("/workers")
    except httpx.HTTPError:
        return []
    return worker_urls_of(response.json()) if response.status_code == 200 else []
