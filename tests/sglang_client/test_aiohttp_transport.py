"""The aiohttp transport under the engine client: pooling, streams cut short, and every transport fault typed.

The servers here are raw asyncio TCP servers on 127.0.0.1 written to misbehave on purpose (fault injection):
a real engine never drops a request half-answered on demand.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import EngineClient, EngineError, EngineUnavailable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class FaultServer:
    """A TCP server whose `handler` decides what each connection gets; counts connections and their closes."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer)
            finally:
                writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0
    )
    return await reader.readexactly(length)


def json_reply(body: object, status: str = "200 OK") -> bytes:
    payload = json.dumps(body).encode()
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    return head.encode() + payload


@pytest.fixture
async def echo_url() -> AsyncIterator[tuple[str, FaultServer]]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: answer every request on this connection
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(json_reply({"text": "ok", "echo": json.loads(body or b"{}"), "meta_info": {}}))
            await writer.drain()

    server = FaultServer(echo)
    async with server as url:
        yield url, server


async def test_sequential_requests_reuse_one_pooled_connection(echo_url: tuple[str, FaultServer]) -> None:
    url, server = echo_url
    async with EngineClient(url) as client:
        for i in range(5):
            reply = await client.generate({"input_ids": [i]})
            assert reply["echo"] == {"input_ids": [i]}
    assert server.connections == 1


async def test_json_calls_and_raw_requests_share_one_pooled_connection(echo_url: tuple[str, FaultServer]) -> None:
    """`_call` goes on the transport directly and `request` through httpx: both must draw on one pool."""
    url, server = echo_url
    async with EngineClient(url) as client:
        await client.generate({"input_ids": [1]})
        raw = await client.request("POST", "/generate", json={"input_ids": [2]})
        assert raw.json()["echo"] == {"input_ids": [2]}
        assert (await client.generate({"input_ids": [3]}))["echo"] == {"input_ids": [3]}
    assert server.connections == 1


async def test_concurrent_requests_each_get_an_answer(echo_url: tuple[str, FaultServer]) -> None:
    url, _ = echo_url
    async with EngineClient(url) as client:
        replies = await asyncio.gather(*(client.generate({"input_ids": [i]}) for i in range(32)))
    assert [reply["echo"]["input_ids"] for reply in replies] == [[i] for i in range(32)]


async def test_error_status_is_an_engine_error_with_the_message() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(json_reply({"error": {"message": "bad input_ids"}}, "400 Bad Request"))
        await writer.drain()

    async with FaultServer(refuse) as url, EngineClient(url) as client:
        with pytest.raises(EngineError, match="bad input_ids") as caught:
            await client.generate({"input_ids": []})
    assert caught.value.status_code == 400


async def test_nothing_listening_is_unavailable() -> None:
    async with EngineClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(EngineUnavailable, match="ConnectError"):
            await client.generate({"input_ids": [1]})


async def test_connection_dropped_before_the_answer_is_unavailable() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)  # then close without a word

    async with FaultServer(drop) as url, EngineClient(url) as client:
        with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
            await client.generate({"input_ids": [1]})


async def test_body_cut_short_is_unavailable() -> None:
    async def truncate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{"te')
        await writer.drain()

    async with FaultServer(truncate) as url, EngineClient(url) as client:
        with pytest.raises(EngineUnavailable):
            await client.generate({"input_ids": [1]})


async def test_silent_server_times_out() -> None:
    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    async with FaultServer(hang) as url, EngineClient(url, timeout_s=0.3) as client:
        with pytest.raises(EngineUnavailable, match="timed out"):
            await client.generate({"input_ids": [1]})


async def test_leaving_a_stream_early_closes_its_connection() -> None:
    """SGLang aborts a streamed request when its connection closes: an early exit must close it, not pool it."""
    server: FaultServer

    async def endless_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i in range(1000):
            event = f'data: {{"text": "{i}", "meta_info": {{}}}}\n\n'.encode()
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            try:
                await writer.drain()
            except ConnectionError:
                break
            if await _peer_closed(reader):
                break
        server.closed_by_client.set()

    server = FaultServer(endless_stream)
    async with server as url, EngineClient(url) as client:
        async for event in client.generate_stream({"input_ids": [1]}):
            if event["text"] == "2":
                break
        await asyncio.wait_for(server.closed_by_client.wait(), timeout=10)


async def _peer_closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), timeout=0.05) == b""
    except TimeoutError:
        return False


def test_one_client_serves_two_event_loops() -> None:
    """A sync caller may run asyncio.run twice with one client: each loop gets its own connections."""

    async def serve_and_call(client: EngineClient) -> dict:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(json_reply({"ok": True}))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", port)
        try:
            return await client.generate({"input_ids": [1]})
        finally:
            server.close()

    port = free_port()
    client = EngineClient(f"http://127.0.0.1:{port}")
    assert asyncio.run(serve_and_call(client)) == {"ok": True}
    assert asyncio.run(serve_and_call(client)) == {"ok": True}
