"""What the checks share: `expect`, request ids and payloads, expected engine errors, and a streaming request
kept running in the background.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Mapping
from types import TracebackType
from typing import Any

from miles_runner.sglang_client import response as res
from miles_runner.sglang_client.client import EngineClient, EngineError
from miles_testkit.contract.base import PROMPT, ContractTarget, ContractViolation


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise ContractViolation(message)


def rid(tag: str) -> str:
    """Unique, prefix-free request ids (abort matches by prefix)."""
    return f"contract-{tag}-{uuid.uuid4().hex}"


def greedy(max_new_tokens: int = 8) -> dict[str, Any]:
    return {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "ignore_eos": True,
    }


def generate_payload(max_new_tokens: int = 8, **fields: Any) -> dict[str, Any]:
    return {"text": PROMPT, "sampling_params": greedy(max_new_tokens), "return_logprob": True, **fields}


async def greedy_logprobs(client: EngineClient, **fields: Any) -> tuple[list[int], list[float]]:
    return res.output_token_logprobs(await client.generate(generate_payload(**fields)))


async def expect_engine_error(call: Awaitable[Any], statuses: tuple[int, ...] = (400,)) -> EngineError:
    try:
        await call
    except EngineError as error:
        expect(error.status_code in statuses, f"expected HTTP {statuses}, got {error.status_code}: {error}")
        expect(bool(error.message), "the error has no message")
        return error
    raise ContractViolation(f"expected HTTP {statuses}, the call succeeded")


class BackgroundStream:
    """A streaming /generate consumed in the background; `started` is set once tokens are flowing.

    On exit an unfinished stream is aborted by its rid, so a failing check leaves nothing running.
    """

    def __init__(self, client: EngineClient, payload: Mapping[str, Any]) -> None:
        self.client = client
        self.rid = str(payload["rid"])
        self.events: list[dict[str, Any]] = []
        self.started = asyncio.Event()
        self.task = asyncio.create_task(self._consume(payload))

    async def _consume(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        try:
            async for event in self.client.generate_stream(payload):
                self.events.append(event)
                if event.get("output_ids"):
                    self.started.set()
        finally:
            self.started.set()
        return self.events[-1]

    @property
    def tokens_so_far(self) -> int:
        return len(self.events[-1]["output_ids"]) if self.events else 0

    async def wait_started(self, timeout_s: float = 60.0) -> None:
        await asyncio.wait_for(self.started.wait(), timeout_s)
        expect(not self.task.done() or self.task.exception() is None, f"stream {self.rid} failed early")

    async def result(self, timeout_s: float = 120.0) -> dict[str, Any]:
        return await asyncio.wait_for(asyncio.shield(self.task), timeout_s)

    async def __aenter__(self) -> BackgroundStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.task.done():
            await self.client.abort_request(self.rid)
            self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def long_stream(target: ContractTarget, tag: str, max_new_tokens: int | None = None) -> BackgroundStream:
    payload = generate_payload(max_new_tokens or target.long_tokens, rid=rid(tag))
    return BackgroundStream(target.client, payload)


async def still_running_after(stream: BackgroundStream, seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return not stream.task.done()
