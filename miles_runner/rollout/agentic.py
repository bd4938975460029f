"""Agentic rollout: an agent plays each episode through the session server with the official OpenAI client.

Per episode: POST /sessions (bound to a multi-LoRA adapter slot when one is given) -> the agent chats at
base_url=.../sessions/{id}/v1 (the server owns the tokens, puts the adapter on every turn and records
everything) -> reward from the transcript -> POST /sessions/{id}/samples (the assembled training sample) ->
DELETE the session, whatever happened.

A turn that comes back aborted (finish_reason "abort": the engine cut it short) ends the episode with
`EpisodeAborted`, and so does a `before_turn` check that says no: nothing more is sent for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from miles_runner.plugins.tasks import Message, Prompt
from miles_runner.rollout.context import RolloutContext
from miles_runner.session.codec import decode_samples
from miles_runner.session.samples import Sample
from miles_runner.sglang_client.client import aiohttp_transport, encode_json, http_client

SESSION_CALL_TIMEOUT_S = 600.0  # an agent's turn waits out the engines' pause for a weight update
BeforeTurn = Callable[[], Awaitable[bool]]  # asked before each turn is sent: may the episode go on?


class EpisodeAborted(Exception):
    """The episode ended early: a turn was aborted by the engine, or `before_turn` stopped it."""


class SessionCallError(RuntimeError):
    """The session server answered a session call of the rollout (create, samples) with an error status."""

    def __init__(self, call: str, status_code: int, text: str) -> None:
        super().__init__(f"{call} answered {status_code}: {text}")
        self.status_code = status_code


class SessionClients:
    """One connection pool to the session server for many episodes: the episode's own calls (create, samples,
    delete) and the OpenAI client the agents chat through (each episode's client is a cheap view of it, pointed at
    its session)."""

    def __init__(self, session_url: str, *, api_key: str | None = None) -> None:
        import openai

        self.url = session_url
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # the run's key, on every call
        self._timeout = dict.fromkeys(("pool", "connect", "read"), SESSION_CALL_TIMEOUT_S)
        self.transport = aiohttp_transport(max_connections=1024)
        self.http = http_client(
            session_url, timeout_s=SESSION_CALL_TIMEOUT_S, headers=self._headers or None, transport=self.transport
        )
        self.openai = openai.AsyncOpenAI(base_url=session_url, api_key=api_key or "local", http_client=self.http)

    def agent_client(self, session_id: str) -> Any:
        return self.openai.with_options(base_url=f"{self.url}/sessions/{session_id}/v1")

    async def create_session(self, adapter: dict[str, Any] | None = None) -> str:
        """POST /sessions (bound to `adapter`'s slot when given): the new session's id."""
        body = encode_json({"adapter": adapter}) if adapter else None
        return json.loads(await self._call("POST", "/sessions", body))["session_id"]

    async def samples(self, session_id: str) -> bytes:
        """POST /sessions/{id}/samples: the session's assembled samples (session/codec.py)."""
        return await self._call("POST", f"/sessions/{session_id}/samples", b'{"max_seq_len":null}')

    async def delete_session(self, session_id: str) -> None:
        """DELETE /sessions/{id}; an unknown session (already reaped) is no error."""
        await self._call("DELETE", f"/sessions/{session_id}", None, check=False)

    async def _call(self, method: str, path: str, body: bytes | None, *, check: bool = True) -> bytes:
        """One call on the transport directly, without httpx's request and response objects (through httpx, the three
        session calls cost a large share of an episode's client CPU); transport failures raise httpx's errors."""
        headers = {**self._headers, "Content-Type": "application/json"} if body is not None else self._headers
        answer = await self.transport.fetch(
            method, f"{self.url}{path}", headers=headers, content=body, timeout=self._timeout
        )
        if check and answer.status != 200:
            text = answer.content.decode(errors="replace")
            raise SessionCallError(f"session server {method} {path}", answer.status, text)
        return answer.content

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> SessionClients:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


async def rollout_agentic(
    ctx: RolloutContext, prompts: list[Prompt], clients: SessionClients | None = None
) -> list[Sample]:
    """Every prompt's group of episodes, all at once. `clients`: the run's open SessionClients, so each rollout
    reuses the connections of the previous one (without: a pool of this rollout's own, closed at its end)."""
    if clients is None:
        async with SessionClients(str(ctx.session_url), api_key=ctx.api_key) as own:
            return await rollout_agentic(ctx, prompts, own)
    n = ctx.plan.batch.n_samples_per_prompt
    return list(await asyncio.gather(*(play_episode(ctx, clients, p) for p in prompts for _ in range(n))))


async def play_episode(
    ctx: RolloutContext,
    clients: SessionClients,
    prompt: Prompt,
    *,
    adapter: dict[str, Any] | None = None,
    before_turn: BeforeTurn | None = None,
) -> Sample:
    """One episode of `ctx.agent` on `ctx.task`, scored by `ctx.reward`, in a session of its own; `adapter`
    ({"name", "lora_name", "version"}) binds the session to a multi-LoRA slot. Raises EpisodeAborted."""
    session_id = await clients.create_session(adapter)
    try:
        assert ctx.agent is not None, "an agentic rollout has the plan's agent"
        chat = chat_fn(ctx, clients.agent_client(session_id), before_turn)
        episode = await ctx.agent(ctx.task, prompt, chat, ctx.plan.rollout.max_turns)
        [sample] = decode_samples(await clients.samples(session_id)).samples
    except BaseException:
        # The episode's own error (a cancel, a server gone) is the one to raise: a session server that is gone
        # would fail the delete too, and that error would replace it.
        with contextlib.suppress(httpx.HTTPError):
            await clients.delete_session(session_id)
        raise
    await clients.delete_session(session_id)
    sample.reward = ctx.reward(prompt, episode.replies)
    sample.metadata.update(prompt_index=prompt.index, label=prompt.label, turns=len(episode.replies))
    return sample


def chat_fn(ctx: RolloutContext, client: Any, before_turn: BeforeTurn | None = None):
    from openai.types.chat import ChatCompletion

    params = ctx.sampling_params()

    async def chat(messages: list[Message]) -> str:
        if before_turn is not None and not await before_turn():
            raise EpisodeAborted("stopped before the next turn")
        # The body chat.completions.create would send, through the same client and into the same ChatCompletion,
        # without create()'s walk of every message against the SDK's typed-dict unions, which changes nothing in
        # plain-text messages and costs CPU on every call of every turn of a step.
        body = {
            "messages": messages,
            "model": "default",
            "max_tokens": params["max_new_tokens"],
            "temperature": params["temperature"],
            "top_p": params["top_p"],
            "top_k": params["top_k"],  # not OpenAI's: SGLang's chat request takes it
        }
        completion = await client.post("/chat/completions", body=body, cast_to=ChatCompletion)
        choice = completion.choices[0]
        if choice.finish_reason == "abort":
            raise EpisodeAborted(f"turn {completion.id} was aborted by the engine")
        return choice.message.content or ""

    return chat
