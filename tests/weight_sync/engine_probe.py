"""What the sync tests observe on the engine, through the one EngineClient."""

from __future__ import annotations

import asyncio
from pathlib import Path

from miles_runner.sglang_client.client import EngineClient

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


async def disk_logprobs(client: EngineClient, adapter_path: Path) -> list[float]:
    """greedy_logprobs of the adapter saved at `adapter_path`, loaded from disk for the call under a name of its own:
    what a synced adapter must serve."""
    name = f"disk_{adapter_path.name}"
    await client.load_lora_adapter(name, adapter_path)
    try:
        return await greedy_logprobs(client, name)
    finally:
        await client.unload_lora_adapter(name)


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
