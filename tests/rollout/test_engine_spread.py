"""Every engine a plan starts serves rollouts, and routing replay (R3) survives a router (sglang_client/engine_pool.py).

Two embedded engines with R3 on, told apart by `--weight-version`: every result reports the version of the
engine that generated it, so which engine served a sample is read from the engine's own answer. Behind the
real sglang-router (0.3.2) and without one, single-turn groups go as /generate straight to one worker each, and
sessions are pinned to one engine each."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.procs.process import ProcessGroup
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import rollout_single_turn
from miles_runner.session.app import create_app
from miles_runner.session.config import read_num_layers
from miles_runner.session.samples import Sample
from miles_runner.session.server import build_parser, config_from_args
from miles_runner.sglang_client.engine_pool import EnginePool
from miles_runner.sglang_client.routed_experts import decode_routed_experts
from miles_testkit.launch import embedded_engine_argv, engine_process, start_router
from miles_testkit.servers import ThreadedServer

pytestmark = pytest.mark.integration

LABELS = ("engine-a", "engine-b")
PROMPTS = 6
SESSIONS = 4


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The default CPU plan (2 engines, no router) with R3, short answers and 2 samples per prompt."""
    overrides = ["rollout.routing_replay=true", "rollout.max_response_len=4", "rollout.n_samples_per_prompt=2"]
    return compile_plan(compose(overrides))


@pytest.fixture(scope="module")
def engines(plan: Plan, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """engine label -> URL: the plan's model on two embedded engines, R3 on, the base model only."""
    logs = tmp_path_factory.mktemp("engines")
    ports = {label: free_port() for label in LABELS}
    with ProcessGroup() as group:
        processes = [
            group.adopt(
                engine_process(
                    engine_argv(plan, port, label), port=port, log_path=logs / f"{label}.log", timeout_s=300
                ).start()
            )
            for label, port in ports.items()
        ]
        for process in processes:  # started together, so their start-ups overlap
            process.wait_healthy()
        yield {label: f"http://{LOOPBACK}:{port}" for label, port in ports.items()}


def engine_argv(plan: Plan, port: int, label: str) -> list[str]:
    return embedded_engine_argv(
        plan.model_path,
        port,
        "--random-seed",
        str(plan.seed),
        "--weight-version",
        label,
        "--enable-return-routed-experts",
    )


@pytest.fixture(scope="module")
def router_url(engines: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    process = start_router(list(engines.values()), port=port, log_path=tmp_path_factory.mktemp("router") / "log")
    yield f"http://{LOOPBACK}:{port}"
    process.stop()


def single_turn(plan: Plan, router_url: str | None, engine_urls: list[str]) -> list[list[Sample]]:
    """The runner's single-turn rollout of PROMPTS prompts, as the loops build it; the samples per group."""

    async def run() -> list[Sample]:
        async with EnginePool.for_deployment(router_url, engine_urls, timeout_s=300) as workers:
            ctx = dataclasses.replace(RolloutContext.from_plan(plan, workers, None), lora_name=None)
            return await rollout_single_turn(ctx, [ctx.task.prompt(i) for i in range(PROMPTS)])

    samples, n = asyncio.run(run()), plan.batch.n_samples_per_prompt
    return [samples[i : i + n] for i in range(0, len(samples), n)]


@pytest.fixture(scope="module")
def behind_router(plan, router_url) -> list[list[Sample]]:
    return single_turn(plan, router_url, [])


@pytest.fixture(scope="module")
def without_router(plan, engines) -> list[list[Sample]]:
    return single_turn(plan, None, list(engines.values()))


def served_by(group: list[Sample]) -> set[str]:
    return {version for sample in group for version in sample.weight_versions}


def test_behind_the_router_every_sample_keeps_one_r3_row_per_token_equal_to_a_direct_requests(
    behind_router, engines, plan
):
    num_layers = read_num_layers(Path(plan.model_path))
    for group in behind_router:
        [label] = served_by(group)
        for sample in group:
            assert sample.rollout_routed_experts.shape[:2] == (len(sample.tokens) - 1, num_layers)
            oracle = direct_routing(engines[label], sample.tokens[:-1], num_layers)
            assert sample.rollout_routed_experts.tobytes() == oracle.tobytes()


def direct_routing(engine_url: str, input_ids: list[int], num_layers: int):
    """The routing of every token but the last, from one greedy token straight to the engine (the reference)."""
    payload = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_routed_experts": True,
    }
    reply = httpx.post(f"{engine_url}/generate", json=payload, timeout=120, trust_env=False)
    reply.raise_for_status()
    return decode_routed_experts(reply.json()["meta_info"]["routed_experts"], len(input_ids), num_layers)


@pytest.mark.parametrize("rollout", ["behind_router", "without_router"])
def test_single_turn_groups_are_served_by_both_engines(rollout, request):
    groups = request.getfixturevalue(rollout)
    assert set().union(*map(served_by, groups)) == set(LABELS)


@pytest.mark.parametrize("rollout", ["behind_router", "without_router"])
def test_a_groups_samples_all_come_from_one_engine(rollout, request):
    groups = request.getfixturevalue(rollout)
    assert all(len(served_by(group)) == 1 for group in groups), [served_by(group) for group in groups]


def test_without_a_router_sessions_are_spread_over_every_engine_given(engines, plan):
    urls = list(engines.values())
    flags = [arg for url in urls for arg in ("--engine-url", url)]  # as plan/render.py session_argv writes them
    config = config_from_args(build_parser().parse_args([*flags, "--model-path", plan.model_path, "--port", "0"]))
    server = ThreadedServer(create_app(config)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120, trust_env=False) as http:
            ids = [http.post("/sessions").json()["session_id"] for _ in range(SESSIONS)]
            for session_id in ids:  # all open together: each new one goes to the engine with fewer
                chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                assert http.post(f"/sessions/{session_id}/v1/chat/completions", json=chat).status_code == 200
            served = [session_served_by(http.get(f"/sessions/{session_id}").json()) for session_id in ids]
    finally:
        server.stop()
    assert served.count({"engine-a"}) == served.count({"engine-b"}) == SESSIONS // 2


def session_served_by(view: dict) -> set[str]:
    return {record["response"]["choices"][0]["meta_info"]["weight_version"] for record in view["records"]}


def test_the_plans_session_server_is_given_every_engine_when_there_is_no_router():
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic_router", "router=none", "session.port=30001"]))
    config = config_from_args(build_parser().parse_args(plan.session.launch.argv[3:]))
    assert config.engine_urls == tuple(engine.launch.url for engine in plan.engines) and len(config.engine_urls) == 2
    assert not config.behind_router
