"""The rollout producer (docs/system.md §4.6 `AsyncMultiLoRAWorker`): groups for every live adapter, independent of
the trainer, into `AdapterBuffers`.

It keeps up to `concurrency` group tasks in flight, always topping up the sampleable adapter with the
smallest backlog (buffered + in flight), and stops feeding an adapter whose backlog reaches
`max_backlog_groups` (default: two of its optimizer steps). Each group is stamped at submission with the
adapter's slot, slot version and registration id; a group with any ABORTED sample is dropped whole, and so
is one whose adapter was retired or re-registered while it was generated. If the producer itself fails,
the failure is stored in the buffers and the next `collect_batch` raises it.

What a group is made of is injected: `next_prompt(run, index)` picks the prompt and
`generate_group(run, prompt)` produces its samples. A generate function must get its request fields from
`request_fields(cache, run)` right before each POST, and mark the sample ABORTED without posting when that
returns None (the adapter is no longer sampleable: an orphan would decode under the slot's next tenant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from miles_runner.core.adapters import adapter_request_fields
from miles_runner.multi_lora.buffers import AdapterBuffers, Group
from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.session.samples import Sample, SampleStatus

log = logging.getLogger(__name__)

NextPrompt = Callable[[AdapterRun, int], Any]
GenerateGroup = Callable[[AdapterRun, Any], Awaitable[list[Sample]]]
POLL_S = 0.01


async def sampleable_tenant(cache: AdaptersCache, run: AdapterRun) -> AdapterRun | None:
    """`run`'s tenant as the cache has it now (its slot, its latest version), or None if nothing may be posted
    for it any more: retired, or its name re-registered since `run` was taken."""
    current = await cache.get(run.name)
    return current if current is not None and current.registration_id == run.registration_id else None


async def request_fields(cache: AdaptersCache, run: AdapterRun) -> dict[str, str] | None:
    """`lora_path`, `rid` and `extra_key` for one request of `run`'s tenant, or None if it may not be posted."""
    current = await sampleable_tenant(cache, run)
    if current is None:
        return None
    return adapter_request_fields(run.name, current.lora_name, current.version)


def stamp(samples: list[Sample], run: AdapterRun) -> None:
    """What the samples were generated under, for the checks downstream and for the trainer."""
    for sample in samples:
        sample.metadata = {
            **run.config.metadata,
            **sample.metadata,
            "adapter": run.name,
            "slot": run.slot,
            "slot_version": run.version,
            "registration_id": run.registration_id,
        }


class GroupProducer:
    def __init__(
        self,
        cache: AdaptersCache,
        buffers: AdapterBuffers,
        next_prompt: NextPrompt,
        generate_group: GenerateGroup,
        *,
        concurrency: int,
        max_backlog_groups: int | None = None,
        poll_s: float = POLL_S,
    ) -> None:
        self.cache = cache
        self.buffers = buffers
        self._next_prompt = next_prompt
        self._generate_group = generate_group
        self.concurrency = concurrency
        self.max_backlog_groups = max_backlog_groups
        self._poll_s = poll_s
        self._tasks: dict[asyncio.Task[None], str] = {}
        self._next_index: Counter[str] = Counter()
        self._loop_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self.run(), name="multi-lora-producer")

    async def stop(self) -> None:
        tasks = [t for t in (self._loop_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()

    async def run(self) -> None:
        try:
            while True:
                self._reap()
                self._fill(await self.cache.get_all())
                await asyncio.sleep(self._poll_s)
        except Exception as error:
            log.exception("the multi-LoRA producer died")
            self.buffers.fail(error)
            raise

    def _reap(self) -> None:
        for task in [task for task in self._tasks if task.done()]:
            del self._tasks[task]
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error

    def _fill(self, live: dict[str, AdapterRun]) -> None:
        while len(self._tasks) < self.concurrency:
            hungry = [run for run in live.values() if self._backlog(run.name) < self._backlog_limit(run)]
            if not hungry:
                return
            self._submit(min(hungry, key=lambda run: (self._backlog(run.name), run.slot)))

    def _backlog_limit(self, run: AdapterRun) -> int:
        """Two optimizer steps ahead by default: enough to never starve the trainer, not so much that the
        groups go stale in the buffer."""
        return self.max_backlog_groups or 2 * run.config.rollout_batch_size

    def _backlog(self, name: str) -> int:
        return self.buffers.buffered(name) + sum(1 for owner in self._tasks.values() if owner == name)

    def _submit(self, run: AdapterRun) -> None:
        index = self._next_index[run.name]
        self._next_index[run.name] += 1
        task = asyncio.create_task(self._process_group(run, index), name=f"group:{run.name}:{index}")
        self._tasks[task] = run.name

    async def _process_group(self, run: AdapterRun, index: int) -> None:
        samples = await self._generate_group(run, self._next_prompt(run, index))
        if any(sample.status is SampleStatus.ABORTED for sample in samples):
            self.buffers.count_drop(run.name, "aborted")
            return
        current = await self.cache.get(run.name)
        if current is None or current.registration_id != run.registration_id:
            self.buffers.count_drop(run.name, "straggler")
            return
        stamp(samples, run)
        self.buffers.put(Group(run.name, index, samples, run.slot, run.version, run.registration_id))
