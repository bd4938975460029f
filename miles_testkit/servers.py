"""In-process servers for tests, on loopback: `ThreadedServer` runs an ASGI app with uvicorn in a thread, and
`RecordingProxy`, a test instrument, forwards every request to a real engine unchanged while keeping what was
sent, so a test can check the bodies the project's own code paths put on the wire.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from miles_runner.procs.ports import LOOPBACK, free_port
from miles_testkit.contract.wire_check import SentRequest

# Hop-by-hop and framing headers: the proxy re-frames the body it passes on.
_NOT_FORWARDED = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class ThreadedServer:
    """A uvicorn server for `app` on a loopback port, running in a daemon thread."""

    def __init__(self, app: FastAPI, port: int | None = None) -> None:
        self.app = app
        self.port = port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> ThreadedServer:
        config = uvicorn.Config(self.app, host=LOOPBACK, port=self.port, log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def request_stop(self) -> None:
        """Ask the server to shut down without waiting (stop() then waits): uvicorn's shutdown waits out a few of its
        polls, so many servers asked first and joined after shut down side by side."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self) -> None:
        if self._server is not None:
            self.request_stop()
            self._thread.join(timeout=30)
            self._server = None


class RecordingProxy:
    """Test instrument: a pass-through proxy to `upstream` (streams included) that records each request's method,
    path and JSON body in `sent`. Use as a context manager; `url` is where clients point instead of the engine."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.sent: list[SentRequest] = []
        self._server = ThreadedServer(self._app())
        self.url = self._server.url

    def __enter__(self) -> RecordingProxy:
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.stop()

    def clear(self) -> None:
        self.sent.clear()

    def paths(self) -> list[str]:
        return [request.path for request in self.sent]

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            raw = await request.body()
            self.sent.append(SentRequest(request.method, f"/{path}", _decoded(raw)))
            return await self._forward(request, f"/{path}", raw)

        return app

    async def _forward(self, request: Request, path: str, raw: bytes) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
        client = httpx.AsyncClient(base_url=self.upstream, timeout=None, trust_env=False)
        upstream = await client.send(
            client.build_request(request.method, path, content=raw, headers=headers, params=request.query_params),
            stream=True,
        )
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in _NOT_FORWARDED}

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()

        return StreamingResponse(body(), status_code=upstream.status_code, headers=kept)


def _decoded(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")  # the wire check reports a body that is not JSON
