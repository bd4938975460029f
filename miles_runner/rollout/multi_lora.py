"""Rollouts for many adapters at once (docs/system.md §4.5, §4.6): the producer's `next_prompt` and `generate_group`.

Each adapter samples prompts from its own task (by registered name) with its own data cursor, is scored by
its own reward and, with a session server, played by its own agent. Without a session server each sample is
one POST to an engine's native /generate, a group's samples all to the one engine it is pinned to while in
flight (sglang_client/engine_pool.py; never through the router, which drops R3); with one, each sample is an agentic
episode (rollout/agentic.py) in a session bound to the adapter's slot, so every turn carries its lora_path,
`name::` rid and extra_key.

Every request, and every session turn, first asks the adapters cache whether its adapter is still sampleable:
one that is not (retired, or its name re-registered) gets an ABORTED sample and nothing more is sent, so
nothing decodes under a slot's next tenant. Aborted answers (a retired adapter's requests cut short on the
engine by the `name::` prefix abort) end their episode and are counted per adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections import Counter
from typing import Any

import httpx

from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.producer import request_fields, sampleable_tenant
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.plugins.agents import AgentFn
from miles_runner.plugins.lookup import get_agent, get_reward, make_task
from miles_runner.plugins.tasks import Prompt, Task
from miles_runner.rollout.agentic import EpisodeAborted, SessionCallError, SessionClients, play_episode
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.single_turn import generate_sample
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.sglang_client.client import EngineError, EngineUnavailable

log = logging.getLogger(__name__)

ADAPTER_NOT_LOADED = "requested LoRA adapters are not loaded"  # SGLang's message (lora_registry.py)
FAILURE_PAUSE_S = 0.5  # between failed requests: no busy loop against an engine that is down
UNAVAILABLE_STATUS = frozenset({502, 503, 504})  # the session server could not reach the engine, or is going away


class MultiLoRARollout:
    def __init__(
        self, ctx: RolloutContext, cache: AdaptersCache, *, seed: int, unreachable_grace_s: float = 60.0
    ) -> None:
        self.ctx = ctx  # the shared engines, tokenizer and sampling settings
        self.cache = cache
        self.seed = seed
        self.cursors: dict[str, int] = {}  # per adapter: the index of its next prompt
        self.aborted: Counter[str] = Counter()  # per adapter: samples that ended aborted (posted or not)
        self.posted: Counter[str] = Counter()  # per adapter: requests posted
        self.tokens_generated = 0  # response tokens of every answer, all adapters
        self.unreachable_grace_s = unreachable_grace_s
        self._failing_since: float | None = None  # when requests started failing (the engine unreachable)
        self._tasks: dict[tuple[str, str], Task] = {}
        self._sessions: SessionClients | None = None  # with a session server: opened at the first episode

    def next_prompt(self, run: AdapterRun, index: int) -> Prompt:
        """The adapter's next prompt (its data cursor moves here, when the producer takes it)."""
        cursor = self.cursors.get(run.name, 0)
        self.cursors[run.name] = cursor + 1
        return self._task(run).prompt(cursor)

    def start_cursor(self, name: str, cursor: int) -> None:
        """Resume: the adapter's prompts continue from `cursor`."""
        self.cursors[name] = cursor

    def forget(self, name: str) -> None:
        """The adapter is gone: a later tenant of its name starts from the beginning of its data."""
        self.cursors.pop(name, None)

    async def generate_group(self, run: AdapterRun, prompt: Prompt) -> list[Sample]:
        ctx = dataclasses.replace(
            self.ctx, task=self._task(run), reward=get_reward(run.config.reward), agent=self._agent(run), lora_name=None
        )
        n, group = run.config.n_samples_per_prompt, f"{run.name}::{uuid.uuid4().hex}"
        try:
            return list(await asyncio.gather(*(self._one(ctx, run, prompt, group) for _ in range(n))))
        finally:
            ctx.engines.release(group)

    async def aclose(self) -> None:
        """Close the connections to the session server (call once the producer has stopped)."""
        if self._sessions is not None:
            await self._sessions.aclose()
            self._sessions = None

    async def _one(self, ctx: RolloutContext, run: AdapterRun, prompt: Prompt, group: str) -> Sample:
        lookup = session_adapter if ctx.session_url else request_fields
        fields = await lookup(self.cache, run)
        if fields is None:
            self.aborted[run.name] += 1
            return unposted_sample(prompt)
        self.posted[run.name] += 1
        try:
            if ctx.session_url:
                sample = await self._episode(ctx, run, prompt, fields)
            else:
                sample = await generate_sample(ctx, await ctx.engines.pin(group), prompt, fields)
        except (EngineUnavailable, EngineError) as error:
            if isinstance(error, EngineError) and not adapter_missing_on_engine(error):
                raise
            return await self._failed(run, prompt, error)
        self._failing_since = None
        self.tokens_generated += sum(sample.loss_mask)  # sampled tokens (a multi-turn answer holds observations)
        if sample.status is SampleStatus.ABORTED:
            self.aborted[run.name] += 1
        return sample

    async def _failed(self, run: AdapterRun, prompt: Prompt, error: Exception) -> Sample:
        """A dropped connection, or an engine that is restarting (or restarted and not yet given its adapters),
        costs groups, not the run: the group is dropped and the request paced. Requests failing for longer than
        `unreachable_grace_s` end the run (the producer fails, and the next collect raises)."""
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since > self.unreachable_grace_s:
            raise error
        log.warning("adapter %s: a request failed, its group is dropped: %r", run.name, error)
        self.aborted[run.name] += 1
        await asyncio.sleep(FAILURE_PAUSE_S)
        return unposted_sample(prompt)

    async def _episode(self, ctx: RolloutContext, run: AdapterRun, prompt: Prompt, adapter: dict[str, Any]) -> Sample:
        """One agentic episode in a session bound to the adapter's slot. Every turn first checks that the adapter
        is still sampleable; an aborted turn ends the episode ABORTED. A session server or engine out of reach
        reads as EngineUnavailable."""

        async def still_sampleable() -> bool:
            return await sampleable_tenant(self.cache, run) is not None

        clients = self._session_clients()
        try:
            return await play_episode(ctx, clients, prompt, adapter=adapter, before_turn=still_sampleable)
        except EpisodeAborted:
            return unposted_sample(prompt)
        except Exception as error:
            if session_unreachable(error) or adapter_missing_on_engine(error):
                raise EngineUnavailable(f"adapter {run.name}: episode failed: {error!r}") from error
            raise

    def _session_clients(self) -> SessionClients:
        if self._sessions is None:
            self._sessions = SessionClients(str(self.ctx.session_url), api_key=self.ctx.api_key)
        return self._sessions

    def _agent(self, run: AdapterRun) -> AgentFn | None:
        """The adapter's own agent plug-in, else the plan's (None without a session server)."""
        return get_agent(run.config.agent) if run.config.agent and self.ctx.session_url else self.ctx.agent

    def dataset_rows(self, run: AdapterRun) -> int | None:
        """The number of prompts in the adapter's data file (one epoch), or None for a generated task."""
        task = self._task(run)
        return len(task.rows()) if task.needs_data else None

    def _task(self, run: AdapterRun) -> Task:
        key = (run.config.task, run.config.data)  # adapters on one task may read different data files
        if key not in self._tasks:
            self._tasks[key] = make_task(run.config.task, self.seed, run.config.data)
        return self._tasks[key]


async def session_adapter(cache: AdaptersCache, run: AdapterRun) -> dict[str, Any] | None:
    """The slot binding of a session for `run`'s tenant (POST /sessions {"adapter": ...}): its turns then carry
    the fields `request_fields` gives. None: the adapter may no longer be sampled (create no session)."""
    current = await sampleable_tenant(cache, run)
    if current is None:
        return None
    return {"name": run.name, "lora_name": current.lora_name, "version": current.version}


def session_unreachable(error: Exception) -> bool:
    """Whether an episode failed for want of the session server or of the engine behind it."""
    import openai

    if isinstance(error, httpx.TransportError | openai.APIConnectionError):
        return True
    return isinstance(error, SessionCallError | openai.APIStatusError) and error.status_code in UNAVAILABLE_STATUS


def adapter_missing_on_engine(error: Exception) -> bool:
    """SGLang's 400 for a request naming an adapter it has not loaded: an engine that restarted and has not been
    given its adapters again yet (the driver pushes them all before its next step)."""
    import openai

    if isinstance(error, EngineError | openai.BadRequestError):
        return error.status_code == 400 and ADAPTER_NOT_LOADED in str(error)
    return False


def unposted_sample(prompt: Prompt) -> Sample:
    """A sample with no tokens, ABORTED: its request was not posted (the adapter is no longer sampleable) or
    its answer cannot be trained on (the request failed, or its episode ended aborted)."""
    return Sample(
        tokens=[],
        response_length=0,
        loss_mask=[],
        rollout_log_probs=[],
        rollout_routed_experts=None,
        status=SampleStatus.ABORTED,
        metadata={"prompt_index": prompt.index, "label": prompt.label},
    )
