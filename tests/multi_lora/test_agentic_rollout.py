"""Multi-LoRA rollouts through the session server (docs/system.md §2, §4.5, §4.6): with a session server, each sample of
a group is an agentic episode played with the official OpenAI client in a session bound to the adapter's slot,
on the embedded CPU engine (two slots loaded); the session server runs in this event loop over real HTTP."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from miles_runner.config.compose import compose
from miles_runner.core.adapters import rid_prefix
from miles_runner.core.errors import PlanError
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.multi_lora.cache import AdaptersCache, in_process
from miles_runner.multi_lora.config import resolve_adapter_config
from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Plan
from miles_runner.plugins.lookup import get_agent, get_reward, make_task
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.rollout.agentic import SessionCallError, SessionClients, rollout_agentic
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.multi_lora import MultiLoRARollout
from miles_runner.session.app import create_app
from miles_runner.session.config import AdapterSlot, SessionServerConfig
from miles_runner.session.core import SessionCore
from miles_runner.session.samples import SampleStatus
from miles_runner.session.tito import TitoTokenizer
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import EnginePool

from .helpers import LIMITS, defaults, eventually, run, serve, snapshot

pytestmark = pytest.mark.integration

LONG = 1500  # new tokens: a turn that stays in flight until it is aborted


@pytest.fixture(scope="module")
def model_dir():
    return ensure_tiny_model("tiny-moe")


@pytest.fixture(scope="module")
def tito(model_dir) -> TitoTokenizer:
    return TitoTokenizer.from_model_path(model_dir)


@pytest.fixture(scope="module")
def plan() -> Plan:
    """The multi-LoRA recipe with a session server: greedy, so a turn's answer is the same on every run."""
    return compile_plan(
        compose(["+recipe=tiny_multi_lora", "session=v1", "rollout.max_turns=2", "rollout.temperature=0"])
    )


@dataclass
class SessionServer:
    url: str
    core: SessionCore
    created: list[AdapterSlot | None] = field(default_factory=list)  # the binding of every session created
    upstream: list[dict[str, Any]] = field(default_factory=list)  # every turn's /generate body as sent
    before_upstream: Callable[[], None] = lambda: None  # runs as each turn is sent


@pytest.fixture
async def session_server(engine_url, model_dir, tito) -> AsyncIterator[SessionServer]:
    """A session server in front of the engine; it records (then does as usual) each session it creates and
    each turn it sends upstream, since a session's own records go with it when it is deleted."""
    app = create_app(SessionServerConfig(engine_url=engine_url, model_path=str(model_dir)), tito)
    async with serve(app) as [url]:
        server = SessionServer(url, app.state.core)
        create, send = server.core.create, server.core.upstream.generate

        def recorded_create(adapter: AdapterSlot | None = None):
            server.created.append(adapter)
            return create(adapter)

        async def recorded_send(session_id: str, body: dict[str, Any]) -> dict[str, Any]:
            server.upstream.append(dict(body))
            server.before_upstream()
            return await send(session_id, body)

        server.core.create, server.core.upstream.generate = recorded_create, recorded_send
        yield server


@pytest.fixture
async def engine(engine_url) -> AsyncIterator[EngineClient]:
    async with EngineClient(engine_url, timeout_s=120) as client:
        yield client


@pytest.fixture
async def engines(engine_url) -> AsyncIterator[EnginePool]:
    async with EnginePool.for_deployment(None, [engine_url], timeout_s=120) as pool:
        yield pool


def context(plan: Plan, engines: EnginePool, session_url: str | None, tito, **rollout: Any) -> RolloutContext:
    plan = dataclasses.replace(plan, rollout=dataclasses.replace(plan.rollout, **rollout))
    return RolloutContext(
        plan=plan,
        engines=engines,
        tokenizer=tito,
        task=make_task("count", plan.seed),
        reward=get_reward("exact_match"),
        agent=get_agent(plan.rollout.agent),
        session_url=session_url,
        lora_name=None,
    )


def cache_of(current: Callable[[], RegistrySnapshot]) -> AdaptersCache:
    """A cache over `current()`, asked again on every lookup."""
    return AdaptersCache(in_process(current), ttl_s=0.0)


def retry_adapter(slot: int = 1, n: int = 2) -> AdapterRun:
    return run("retry", slot, version=3, task="count_retry", n_samples_per_prompt=n)


async def play_group(rollout: MultiLoRARollout, adapter: AdapterRun):
    try:
        return await rollout.generate_group(adapter, rollout.next_prompt(adapter, 0))
    finally:
        await rollout.aclose()


# ---- episodes -------------------------------------------------------------------------------------------


async def test_each_sample_is_an_episode_whose_turns_all_carry_the_adapters_slot_rid_and_version(
    session_server, engines, plan, tito
):
    adapter = retry_adapter(slot=1)
    rollout = MultiLoRARollout(
        context(plan, engines, session_server.url, tito), cache_of(lambda: snapshot(adapter)), seed=0
    )
    samples = await play_group(rollout, adapter)
    assert session_server.created == [AdapterSlot("retry", "__miles_slot_1", 3)] * 2
    assert [s.metadata["turns"] for s in samples] == [2, 2]  # a wrong first answer is told so, and tried again
    assert len(session_server.upstream) == 4
    for body in session_server.upstream:
        assert body["lora_path"] == "__miles_slot_1" and body["extra_key"] == "retry:v3"
        assert body["rid"].startswith("retry::")
    assert len({body["rid"] for body in session_server.upstream}) == 4  # a fresh rid per turn
    assert all(s.tokens and s.reward in (0.0, 1.0) for s in samples)
    assert not session_server.core.sessions  # every session is deleted after its samples were collected


async def test_a_session_is_bound_to_the_adapters_latest_version(session_server, engines, plan, tito):
    stamped = retry_adapter(slot=0, n=1)
    pushed = dataclasses.replace(stamped, version=5)  # the weights were pushed again after the group was taken
    rollout = MultiLoRARollout(
        context(plan, engines, session_server.url, tito), cache_of(lambda: snapshot(pushed)), seed=0
    )
    await play_group(rollout, stamped)
    assert session_server.created == [AdapterSlot("retry", "__miles_slot_0", 5)]
    assert {body["extra_key"] for body in session_server.upstream} == {"retry:v5"}


async def test_an_adapter_no_longer_sampleable_gets_aborted_samples_and_no_session(session_server, engines, plan, tito):
    gone = retry_adapter()
    rollout = MultiLoRARollout(context(plan, engines, session_server.url, tito), cache_of(snapshot), seed=0)
    samples = await play_group(rollout, gone)
    assert [(s.status, s.tokens) for s in samples] == [(SampleStatus.ABORTED, [])] * 2
    assert session_server.created == [] and session_server.upstream == []
    assert rollout.aborted["retry"] == 2 and rollout.posted["retry"] == 0


async def test_a_name_registered_again_gets_no_session_for_the_old_registrations_group(
    session_server, engines, plan, tito
):
    old = retry_adapter()
    new = dataclasses.replace(old, registration_id="reg-again")
    rollout = MultiLoRARollout(
        context(plan, engines, session_server.url, tito), cache_of(lambda: snapshot(new)), seed=0
    )
    samples = await play_group(rollout, old)
    assert {s.status for s in samples} == {SampleStatus.ABORTED}
    assert session_server.created == []


async def test_an_adapter_retired_between_turns_gets_no_further_turn(session_server, engines, plan, tito):
    adapter = retry_adapter(n=1)
    current = {"snapshot": snapshot(adapter)}
    session_server.before_upstream = lambda: current.update(snapshot=RegistrySnapshot())  # retired as turn 1 goes
    rollout = MultiLoRARollout(
        context(plan, engines, session_server.url, tito), cache_of(lambda: current["snapshot"]), seed=0
    )
    [sample] = await play_group(rollout, adapter)
    assert sample.status is SampleStatus.ABORTED
    assert len(session_server.upstream) == 1  # no second turn under a slot it may no longer hold
    assert not session_server.core.sessions


async def test_a_turn_aborted_by_the_adapter_prefix_ends_its_episode_aborted(
    session_server, engine, engines, plan, tito
):
    adapter = retry_adapter()
    ctx = context(plan, engines, session_server.url, tito, max_response_len=LONG)
    rollout = MultiLoRARollout(ctx, cache_of(lambda: snapshot(adapter)), seed=0)
    group = asyncio.create_task(play_group(rollout, adapter))
    await eventually(lambda: len(session_server.upstream) == 2, timeout_s=60)
    while not group.done():  # as the controller does on retire; repeated, in case a turn was not yet scheduled
        await engine.abort_request(rid_prefix("retry"), prefix=True)
        await asyncio.wait({group}, timeout=0.2)
    samples = group.result()
    assert {s.status for s in samples} == {SampleStatus.ABORTED}
    assert len(session_server.upstream) == 2  # the aborted turns were the last: no "Wrong." and second try
    assert rollout.aborted["retry"] == 2
    assert not session_server.core.sessions


async def test_an_unreachable_session_server_costs_the_group_not_the_run(engines, plan, tito):
    adapter = retry_adapter()
    ctx = context(plan, engines, f"http://{LOOPBACK}:{free_port()}", tito)
    rollout = MultiLoRARollout(ctx, cache_of(lambda: snapshot(adapter)), seed=0)
    samples = await play_group(rollout, adapter)
    assert {s.status for s in samples} == {SampleStatus.ABORTED}
    assert rollout.aborted["retry"] == 2


async def test_a_session_server_that_is_shutting_down_costs_the_group_not_the_run(session_server, engines, plan, tito):
    """Its POST /sessions answers 503 (a SessionCallError with that status): read as a session server out of reach,
    as a refused connection is, not as an error of the run."""
    await session_server.core.shutdown()
    adapter = retry_adapter()
    rollout = MultiLoRARollout(
        context(plan, engines, session_server.url, tito), cache_of(lambda: snapshot(adapter)), seed=0
    )
    samples = await play_group(rollout, adapter)
    assert {s.status for s in samples} == {SampleStatus.ABORTED}
    assert rollout.aborted["retry"] == 2 and not session_server.core.sessions


async def test_a_session_call_the_server_refuses_raises_naming_the_call_and_its_answer(session_server):
    async with SessionClients(session_server.url) as clients:
        with pytest.raises(SessionCallError, match=r"POST /sessions answered 400: .*adapter") as refused:
            await clients.create_session({"name": "retry"})  # a binding without its slot
        assert refused.value.status_code == 400
        with pytest.raises(SessionCallError, match="answered 404"):
            await clients.samples("no-such-session")
        await clients.delete_session("no-such-session")  # deleting what is gone is no error


@pytest.mark.parametrize("through_sessions", [True, False], ids=["session", "native"])
async def test_a_slot_the_engine_has_not_loaded_costs_the_group_not_the_run(
    session_server, engines, plan, tito, through_sessions
):
    """An engine that restarted holds no adapter until the driver pushes them again: SGLang answers 400."""
    adapter = retry_adapter(slot=3)  # the engine holds slots 0 and 1 only
    ctx = context(plan, engines, session_server.url if through_sessions else None, tito)
    rollout = MultiLoRARollout(ctx, cache_of(lambda: snapshot(adapter)), seed=0)
    samples = await play_group(rollout, adapter)
    assert [(s.status, s.tokens) for s in samples] == [(SampleStatus.ABORTED, [])] * 2
    assert rollout.aborted["retry"] == 2 and rollout.posted["retry"] == 2


async def test_the_single_adapter_agentic_rollout_plays_n_episodes_per_prompt(session_server, engines, plan, tito):
    plan = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, n_samples_per_prompt=2))
    ctx = dataclasses.replace(context(plan, engines, session_server.url, tito), task=make_task("count_retry", 0))
    samples = await rollout_agentic(ctx, [ctx.task.prompt(0)])
    assert [s.metadata["turns"] for s in samples] == [2, 2]
    assert session_server.created == [None, None]  # unbound: the server's own adapter (if any) serves them
    # No adapter slot's "name::uuid" rid (each turn has the session server's own plain rid, for aborts).
    assert not any("::" in body.get("rid", "") for body in session_server.upstream)


async def test_an_episode_that_fails_with_its_session_server_gone_raises_its_own_error(
    engine_url, model_dir, engines, plan, tito
):
    """A stop (Slurm's SIGTERM) takes the session server away mid-episode: the episode's session delete then fails
    too, and the episode's own error, not that one, is what the rollout raises."""
    app = create_app(SessionServerConfig(engine_url=engine_url, model_path=str(model_dir)), tito)
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=free_port(), log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)

    async def agent_losing_its_server(task, prompt, chat, max_turns):
        server.should_exit = True
        await serving
        raise LookupError("the episode's own failure")

    plan = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, n_samples_per_prompt=1))
    ctx = dataclasses.replace(
        context(plan, engines, f"http://{LOOPBACK}:{server.config.port}", tito), agent=agent_losing_its_server
    )
    with pytest.raises(LookupError, match="the episode's own failure"):
        await rollout_agentic(ctx, [ctx.task.prompt(0)])


async def test_rollouts_given_the_runs_session_clients_leave_them_open_for_the_next(
    session_server, engines, plan, tito
):
    """The single-adapter loop opens one SessionClients for the run (one connection pool, reused by every step)."""
    plan = dataclasses.replace(plan, batch=dataclasses.replace(plan.batch, n_samples_per_prompt=1))
    ctx = dataclasses.replace(context(plan, engines, session_server.url, tito), task=make_task("count_retry", 0))
    async with SessionClients(session_server.url) as clients:
        first = await rollout_agentic(ctx, [ctx.task.prompt(0)], clients)
        assert not clients.http.is_closed
        second = await rollout_agentic(ctx, [ctx.task.prompt(1)], clients)
    assert [s.metadata["prompt_index"] for s in first + second] == [0, 1]
    assert clients.http.is_closed


# ---- the per-adapter agent ------------------------------------------------------------------------------


def test_an_adapters_agent_must_be_a_registered_name():
    limits = dataclasses.replace(LIMITS, agents=("feedback_loop", "guess_number"))
    with pytest.raises(ValueError, match=r"adapter 'a' cannot run: unknown agent 'my\.agents:play' \(registered"):
        resolve_adapter_config("a", {"agent": "my.agents:play"}, defaults(), limits)


def test_an_adapters_registered_agent_is_kept_and_none_means_the_runs_agent():
    limits = dataclasses.replace(LIMITS, agents=("feedback_loop", "guess_number"))
    assert resolve_adapter_config("a", {"agent": "guess_number"}, defaults(), limits).agent == "guess_number"
    assert resolve_adapter_config("b", {}, defaults(), limits).agent is None


def test_an_unregistered_adapter_agent_in_the_config_is_a_plan_error_naming_the_field():
    with pytest.raises(PlanError) as error:
        compile_plan(compose(["+recipe=tiny_multi_lora", "session=v1", "++adapters.runs.1.agent=nope"]))
    assert "adapters.runs[1].agent=nope" in str(error.value)
    assert "No agent is registered as 'nope'" in str(error.value)


def test_the_plan_carries_each_adapters_own_agent():
    plan = compile_plan(compose(["+recipe=tiny_multi_lora", "session=v1", "++adapters.runs.1.agent=guess_number"]))
    assert [a.agent for a in plan.adapters] == [None, "guess_number", None]
