"""Single-turn rollouts for many adapters at once (spec §4.5, §4.6): the producer's `next_prompt` and
`generate_group` over the engines' native /generate.

Each adapter samples prompts from its own task (by registered name) with its own data cursor, and is scored
by its own reward. Every request asks `request_fields` right before it is posted: an adapter that is no
longer sampleable (retired, or its name re-registered) gets an ABORTED sample and no request, so nothing
decodes under a slot's next tenant. Aborted answers (a retired adapter's requests cut short on the engine by
the `name::` prefix abort) are counted per adapter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

from miles_runner.engine.client import EngineUnavailable
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.producer import request_fields
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.rollout.context import RolloutContext
from miles_runner.rollout.plugins import get_reward, make_task
from miles_runner.rollout.single_turn import generate_sample
from miles_runner.rollout.tasks import Prompt, Task
from miles_runner.session.samples import Sample, SampleStatus

log = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 32


class MultiLoRARollout:
    def __init__(self, ctx: RolloutContext, cache: AdaptersCache, *, seed: int) -> None:
        self.ctx = ctx  # the shared engine client, tokenizer and sampling settings
        self.cache = cache
        self.seed = seed
        self.cursors: dict[str, int] = {}  # per adapter: the index of its next prompt
        self.aborted: Counter[str] = Counter()  # per adapter: samples that ended aborted (posted or not)
        self.posted: Counter[str] = Counter()  # per adapter: requests posted
        self.tokens_generated = 0  # response tokens of every answer, all adapters
        self.consecutive_failures = 0  # requests that failed in a row (the engine unreachable)
        self._tasks: dict[tuple[str, int], Task] = {}

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
        ctx = dataclasses.replace(self.ctx, task=self._task(run), reward=get_reward(run.config.reward), lora_path=None)
        n = run.config.n_samples_per_prompt
        return list(await asyncio.gather(*(self._one(ctx, run, prompt) for _ in range(n))))

    async def _one(self, ctx: RolloutContext, run: AdapterRun, prompt: Prompt) -> Sample:
        fields = await request_fields(self.cache, run)
        if fields is None:
            self.aborted[run.name] += 1
            return unposted_sample(prompt)
        self.posted[run.name] += 1
        try:
            sample = await generate_sample(ctx, prompt, fields)
        except EngineUnavailable as error:
            return self._failed(run, prompt, error)
        self.consecutive_failures = 0
        self.tokens_generated += sample.response_length
        if sample.status is SampleStatus.ABORTED:
            self.aborted[run.name] += 1
        return sample

    def _failed(self, run: AdapterRun, prompt: Prompt, error: EngineUnavailable) -> Sample:
        """A dropped connection (e.g. a keep-alive closed as the request went out) costs one group, not the run;
        an engine that stays unreachable ends it (the producer fails, and the next collect raises)."""
        self.consecutive_failures += 1
        if self.consecutive_failures > MAX_CONSECUTIVE_FAILURES:
            raise error
        log.warning("adapter %s: a request failed, its group is dropped: %r", run.name, error)
        self.aborted[run.name] += 1
        return unposted_sample(prompt)

    def _task(self, run: AdapterRun) -> Task:
        key = (run.config.task, self.seed)
        if key not in self._tasks:
            self._tasks[key] = make_task(*key)
        return self._tasks[key]


def unposted_sample(prompt: Prompt) -> Sample:
    """The sample of a request that was never posted (its adapter is no longer sampleable)."""
    return Sample(
        tokens=[], response_length=0, loss_mask=[], rollout_log_probs=[], rollout_routed_experts=None,
        status=SampleStatus.ABORTED, metadata={"prompt_index": prompt.index, "label": prompt.label},
    )  # fmt: skip
