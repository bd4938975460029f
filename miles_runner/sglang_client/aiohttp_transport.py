"""An httpx transport that sends over aiohttp: the engine client keeps httpx's API, aiohttp moves the bytes.

Why: httpcore's connection pool re-checks every pooled connection (an `is_readable` poll each) on every request
and every response close, so its cost per request grows with the pool. At high concurrency that scan dominated the
session server's CPU and caused its latency tail (bench/session_latency.py). aiohttp's connector hands
out idle connections from a queue in O(1).

`fetch` sends a whole request and reads the whole answer on aiohttp alone, for the engine client's JSON calls:
httpx's request and response objects (URL parsing, header models, cookies, auth and redirect hooks) cost CPU
on every call of a session server's turn and buy nothing there (bench/session_latency.py).

Errors are raised as the httpx exceptions the callers already handle (timeouts as `httpx.TimeoutException`,
every other transport failure as an `httpx.TransportError`), so `EngineClient` maps them to `EngineUnavailable`
as before. One aiohttp session per event loop: a client used from a second loop (a sync caller running
`asyncio.run` twice) gets its own connections instead of touching another loop's sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx

# aiohttp -> httpx, most specific first (each row's aiohttp class may subclass a later one).
_ERROR_MAP: tuple[tuple[type[BaseException], type[httpx.TransportError]], ...] = (
    (aiohttp.ConnectionTimeoutError, httpx.ConnectTimeout),
    (aiohttp.SocketTimeoutError, httpx.ReadTimeout),
    (asyncio.TimeoutError, httpx.ReadTimeout),  # also aiohttp.ServerTimeoutError
    (aiohttp.ClientConnectorError, httpx.ConnectError),
    (aiohttp.ServerDisconnectedError, httpx.RemoteProtocolError),
    (aiohttp.ClientPayloadError, httpx.ReadError),
    (aiohttp.ClientResponseError, httpx.RemoteProtocolError),  # a malformed status line or headers
    (aiohttp.InvalidURL, httpx.UnsupportedProtocol),
    (aiohttp.ClientError, httpx.NetworkError),
)


@contextlib.contextmanager
def _as_httpx_errors(request: httpx.Request | None) -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError:
        raise
    except (TimeoutError, aiohttp.ClientError) as error:
        mapped = next(target for source, target in _ERROR_MAP if isinstance(error, source))
        raise mapped(f"{type(error).__name__}: {error}", request=request) from error


@dataclass(frozen=True)
class WholeResponse:
    status: int
    reason: str
    content: bytes


class _ResponseBody(httpx.AsyncByteStream):
    CHUNK_BYTES = 64 * 1024

    def __init__(self, response: aiohttp.ClientResponse, request: httpx.Request) -> None:
        self._response, self._request = response, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx_errors(self._request):
            async for chunk in self._response.content.iter_chunked(self.CHUNK_BYTES):
                yield chunk

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # left early (a stream cut short): close it, so SGLang aborts the request


class AiohttpTransport(httpx.AsyncBaseTransport):
    """Plain-HTTP transport for loopback/cluster engines: no proxies from the environment, no TLS options, no
    redirects, bodies passed through undecoded (httpx decodes them)."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._limits = limits
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            self._sessions = {other: s for other, s in self._sessions.items() if not other.is_closed()}
            connector = aiohttp.TCPConnector(
                limit=self._limits.max_connections or 0,
                keepalive_timeout=self._limits.keepalive_expiry,
            )
            session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)
            self._sessions[loop] = session
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout", {})
        with _as_httpx_errors(request):
            response = await self._session().request(
                request.method,
                str(request.url),
                headers=request.headers.multi_items(),
                data=await request.aread() or None,
                allow_redirects=False,
                compress=False,
                timeout=_client_timeout(timeout),
            )
        return httpx.Response(
            response.status,
            headers=list(response.raw_headers),
            stream=_ResponseBody(response, request),
            request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode()},
        )

    async def fetch(
        self, method: str, url: str, *, headers: Mapping[str, str], content: bytes | None, timeout: dict[str, Any]
    ) -> WholeResponse:
        """One request and its whole answer, without httpx's objects; `timeout` as httpx's per-phase dict.
        Asks for an uncompressed answer: nothing here decodes one."""
        with _as_httpx_errors(None):
            async with self._session().request(
                method,
                url,
                headers={**headers, "Accept-Encoding": "identity"},
                data=content,
                allow_redirects=False,
                compress=False,
                timeout=_client_timeout(timeout),
            ) as response:
                return WholeResponse(response.status, response.reason or "", await response.read())

    async def aclose(self) -> None:
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


def _client_timeout(timeout: dict[str, Any]) -> aiohttp.ClientTimeout:
    """httpx's per-phase timeouts: `pool` (waiting for a free connection) and `connect` bound the connect phase,
    `read` each read; there is no total, as with httpx."""
    connect = [t for t in (timeout.get("pool"), timeout.get("connect")) if t is not None]
    return aiohttp.ClientTimeout(
        total=None,
        connect=sum(connect) if connect else None,
        sock_connect=timeout.get("connect"),
        sock_read=timeout.get("read"),
    )
