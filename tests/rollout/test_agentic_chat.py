"""An agent's turn (rollout/agentic.py chat_fn): the official OpenAI client sends what `chat.completions.create`
would send, to the same route, and the reply is read as a ChatCompletion."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from miles_runner.rollout.agentic import EpisodeAborted, chat_fn

MESSAGES = [
    {"role": "system", "content": "You count."},
    {"role": "user", "content": "How many a in banana?"},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "Wrong. Reply with a single number."},
]
SAMPLING = {"max_new_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5}


def completion(finish_reason: str) -> dict:
    return {
        "id": "turn-1",
        "object": "chat.completion",
        "created": 1,
        "model": "default",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "3"}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 1, "total_tokens": 21},
    }


def recording_client(finish_reason: str = "stop") -> tuple[openai.AsyncOpenAI, list[tuple[str, str, dict]]]:
    sent: list[tuple[str, str, dict]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append((request.method, request.url.path, json.loads(request.content)))
        return httpx.Response(200, json=completion(finish_reason))

    transport = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    return openai.AsyncOpenAI(base_url="http://session.test/sessions/s1/v1", api_key="k", http_client=transport), sent


async def test_a_turn_sends_exactly_what_chat_completions_create_sends():
    client, sent = recording_client()
    reply = await chat_fn(SimpleNamespace(sampling_params=lambda: SAMPLING), client)(MESSAGES)
    await client.chat.completions.create(
        model="default", messages=MESSAGES, max_tokens=8, temperature=0.7, top_p=0.9, extra_body={"top_k": 5}
    )
    assert reply == "3"
    ours, sdk = sent
    assert ours == sdk and ours[:2] == ("POST", "/sessions/s1/v1/chat/completions")


async def test_a_turn_the_engine_aborted_ends_the_episode():
    client, _ = recording_client("abort")
    with pytest.raises(EpisodeAborted, match="turn-1 was aborted"):
        await chat_fn(SimpleNamespace(sampling_params=lambda: SAMPLING), client)(MESSAGES)
