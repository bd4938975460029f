"""The rollout's sampling settings (rollout.max_response_len, temperature, top_p, top_k) reach the engine as SGLang
sampling params, on the single-turn /generate path and on the agentic path through the session server. What the
engine receives is read from the RecordingProxy (a test instrument that forwards every request unchanged)."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.rollout.agentic import SessionClients, play_episode
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import generate_sample
from miles_runner.session.app import create_app as create_session_app
from miles_runner.session.config import SessionServerConfig
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import EnginePool
from miles_testkit.servers import ThreadedServer

pytestmark = pytest.mark.integration

SAMPLING = {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.8, "top_k": 5}
# The plain tiny model, which the `tiny_moe_dir` fixture builds and the contract engine serves.
OVERRIDES = (
    "model.path=tiny:tiny-moe",
    "rollout.max_response_len=3",
    "rollout.temperature=0.7",
    "rollout.top_p=0.8",
    "rollout.top_k=5",
)


def sent_sampling_params(proxy) -> list[dict]:
    return [request.body["sampling_params"] for request in proxy.sent if request.path == "/generate"]


async def test_single_turn_requests_sample_with_the_plans_settings(recording_proxy, tiny_moe_dir):
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic", "session=off", *OVERRIDES]))
    async with EnginePool.for_deployment(None, [recording_proxy.url], timeout_s=120) as workers:
        ctx = RolloutContext.from_plan(plan, workers, None)
        sample = await generate_sample(ctx, await workers.pin("group"), ctx.task.prompt(0), {"rid": "sampling-single"})
    assert sent_sampling_params(recording_proxy) == [SAMPLING]
    assert 1 <= sample.response_length <= 3


async def test_session_turns_sample_with_the_plans_settings(recording_proxy, tiny_moe_dir):
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic", *OVERRIDES]))
    config = SessionServerConfig(engine_url=recording_proxy.url, model_path=str(tiny_moe_dir))
    session = ThreadedServer(create_session_app(config)).start()
    try:
        async with EngineClient(recording_proxy.url) as client, SessionClients(session.url) as clients:
            ctx = RolloutContext.from_plan(plan, client, session.url)
            sample = await play_episode(ctx, clients, ctx.task.prompt(0))
    finally:
        session.stop()
    sent = sent_sampling_params(recording_proxy)
    assert sent and all({key: params.get(key) for key in SAMPLING} == SAMPLING for params in sent)
    assert 1 <= sample.metadata["turns"] <= plan.rollout.max_turns
