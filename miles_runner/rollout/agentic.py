"""Agentic rollout: an agent plays each episode through the session server with the official OpenAI client.

Per episode: POST /sessions -> the agent chats at base_url=.../sessions/{id}/v1 (the server owns the tokens,
puts the adapter on every turn and records everything) -> reward from the transcript -> POST
/sessions/{id}/samples (the assembled training sample) -> DELETE the session, whatever happened.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from miles_runner.engine.client import pool_limits
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.tasks import Message, Prompt
from miles_runner.session.codec import decode_samples
from miles_runner.session.samples import Sample


async def rollout_agentic(ctx: RolloutContext, prompts: list[Prompt]) -> list[Sample]:
    import openai

    n = ctx.plan.batch.n_samples_per_prompt
    # One connection pool for the whole rollout: each episode's OpenAI client is a cheap view onto it.
    async with httpx.AsyncClient(base_url=str(ctx.session_url), timeout=600, trust_env=False,
                                 limits=pool_limits()) as http:
        agents = openai.AsyncOpenAI(base_url=str(ctx.session_url), api_key="local", http_client=http)
        episodes = [play_episode(ctx, http, agents, p) for p in prompts for _ in range(n)]
        return list(await asyncio.gather(*episodes))


async def play_episode(ctx: RolloutContext, http: httpx.AsyncClient, agents: Any, prompt: Prompt) -> Sample:
    created = await http.post("/sessions")
    created.raise_for_status()
    session_id = created.json()["session_id"]
    try:
        agent_client = agents.with_options(base_url=f"{ctx.session_url}/sessions/{session_id}/v1")
        episode = await ctx.agent(ctx.task, prompt, chat_fn(ctx, agent_client), ctx.plan.rollout.max_turns)
        reply = await http.post(f"/sessions/{session_id}/samples", json={"max_seq_len": None})
        if reply.status_code != 200:
            raise RuntimeError(f"session {session_id}: /samples answered {reply.status_code}: {reply.text}")
        [sample] = decode_samples(reply.content).samples
    finally:
        await http.delete(f"/sessions/{session_id}")
    sample.reward = ctx.reward(prompt, episode.replies)
    sample.metadata.update(prompt_index=prompt.index, label=prompt.label, turns=len(episode.replies))
    return sample


def chat_fn(ctx: RolloutContext, client: Any):
    params = ctx.sampling_params()

    async def chat(messages: list[Message]) -> str:
        completion = await client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=params["max_new_tokens"],
            temperature=params["temperature"],
            top_p=params["top_p"],
        )
        return completion.choices[0].message.content or ""

    return chat
