"""What the sync tests observe on the engine, through the one EngineClient."""

from __future__ import annotations

import asyncio

from miles_runner.engine.client import EngineClient

PROMPT_IDS = [5, 6, 7, 8, 9, 10]


async def greedy_logprobs(client: EngineClient, adapter: str | None) -> list[float]:
    out = await client.generate(
        {
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
            "lora_path": adapter,
            "return_logprob": True,
        }
    )
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


async def is_paused(client: EngineClient) -> bool:
    return (await client.server_info())["internal_states"][0]["paused"]


async def served_adapters(client: EngineClient) -> list[str]:
    return [card["id"] for card in (await client.list_models())[1:]]


async def start_long_request(client: EngineClient, adapter: str) -> asyncio.Task:
    """A long generation with `adapter`, running on the engine when this returns (unless it already ended)."""
    payload = {
        "input_ids": PROMPT_IDS,
        "sampling_params": {"max_new_tokens": 300, "temperature": 0.0, "ignore_eos": True},
        "lora_path": adapter,
    }
    task = asyncio.create_task(client.generate(payload))
    while not task.done() and (await client.server_info())["internal_states"][0]["num_running_reqs"] == 0:
        await asyncio.sleep(0.01)
    return task
