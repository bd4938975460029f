"""EngineClient behaviour that does not need a model: errors, headers, legacy paths, argument checks.

`FakeOldSGLang` is a fake on loopback, standing in for an older SGLang build (only the legacy /get_* info
paths) so that the fallback and the headers the client sends can be observed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import (
    ROUTING_KEY_HEADER,
    EngineClient,
    EngineError,
    EngineUnavailable,
    error_message,
)


class FakeOldSGLang(BaseHTTPRequestHandler):
    """Answers /get_model_info and /generate (echoing the request headers); everything else is 404."""

    def do_GET(self) -> None:
        if self.path == "/get_model_info":
            self._reply(200, {"model_path": "old", "weight_version": "v-old"})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            self._reply(200, {"headers": {k.lower(): v for k, v in self.headers.items()}})
        else:
            self._reply(404, {"detail": "Not Found"})

    def _reply(self, status: int, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def old_sglang_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOldSGLang)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"error": {"message": "The following requested LoRA adapters are not loaded: x"}}, "are not loaded: x"),
        ({"object": "error", "message": "bad messages", "type": "BadRequestError", "code": 400}, "bad messages"),
        ({"success": False, "error_message": "already loaded", "loaded_adapters": {}}, "already loaded"),
        ({"detail": [{"loc": ["body", "messages"], "msg": "Field required"}]}, "messages"),
        ("Cache not flushed because there are pending requests.", "Cache not flushed"),
    ],
    ids=["native", "openai", "lora_update", "fastapi_validation", "plain_text"],
)
def test_error_message_reads_every_sglang_error_envelope(body: object, message: str) -> None:
    assert message in error_message(body, "fallback")


def test_error_message_falls_back_when_the_body_says_nothing() -> None:
    assert error_message({}, "Bad Request") == "Bad Request"


async def test_unreachable_engine_raises_engine_unavailable() -> None:
    async with EngineClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(EngineUnavailable):
            await client.model_info()
        assert await client.health() is False


async def test_wait_healthy_gives_up_after_its_timeout() -> None:
    async with EngineClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(EngineUnavailable, match="not healthy within"):
            await client.wait_healthy(0.3, poll_s=0.1)


async def test_model_info_falls_back_to_the_legacy_path(old_sglang_url: str) -> None:
    async with EngineClient(old_sglang_url) as client:
        assert await client.weight_version() == "v-old"


async def test_server_info_error_is_typed_when_no_path_exists(old_sglang_url: str) -> None:
    async with EngineClient(old_sglang_url) as client:
        with pytest.raises(EngineError) as failure:
            await client.server_info()
    assert failure.value.status_code == 404


async def test_api_key_and_routing_key_are_sent_as_headers(old_sglang_url: str) -> None:
    async with EngineClient(old_sglang_url, api_key="secret") as client:
        reply = await client.generate({"text": "hi"}, routing_key="session-7")
    assert reply["headers"]["authorization"] == "Bearer secret"
    assert reply["headers"][ROUTING_KEY_HEADER.lower()] == "session-7"


async def test_generate_refuses_the_stream_flag() -> None:
    async with EngineClient("http://127.0.0.1:9") as client:
        with pytest.raises(ValueError, match="generate_stream"):
            await client.generate({"text": "hi", "stream": True})


async def test_abort_request_needs_a_rid_or_abort_all() -> None:
    async with EngineClient("http://127.0.0.1:9") as client:
        with pytest.raises(ValueError, match="abort_all"):
            await client.abort_request()


async def test_pause_generation_rejects_unknown_modes() -> None:
    async with EngineClient("http://127.0.0.1:9") as client:
        with pytest.raises(ValueError, match="in_place"):
            await client.pause_generation("freeze")
