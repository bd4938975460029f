"""One train batch from the adapters' buffers (docs/system.md §4.6 `collect_batch`).

It fills up to `target_samples` (the global batch size) from `AdapterBuffers.get_groups`; a non-empty batch
ships once no group has arrived for `coalesce_wait_s` (or once every adapter has all it needs), and an
empty one gives up after `empty_wait_s` with EmptyBatchTimeoutError, which the driver catches to reconcile
and try again. The adapters whose collected groups complete their step are the batch's `step_names`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from miles_runner.multi_lora.buffers import AdapterBuffers, Group
from miles_runner.multi_lora.registry import RegistrySnapshot
from miles_runner.session.samples import Sample

log = logging.getLogger(__name__)

POLL_S = 0.01
WARN_EVERY_S = 30.0


class EmptyBatchTimeoutError(TimeoutError):
    """No trainable group arrived within the empty wait."""


@dataclass(frozen=True)
class TrainBatch:
    groups: list[Group]  # sorted by (slot, index)
    group_counts: dict[str, int]
    step_names: list[str]  # adapters that complete their rollout_batch_size with this batch, by slot
    step_slots: list[int]

    @property
    def samples(self) -> list[Sample]:
        return [sample for group in self.groups for sample in group.samples]


async def collect_batch(
    buffers: AdapterBuffers,
    snapshot: RegistrySnapshot,
    *,
    target_samples: int,
    coalesce_wait_s: float,
    empty_wait_s: float,
    poll_s: float = POLL_S,
    clock: Callable[[], float] = time.monotonic,
) -> TrainBatch:
    live = snapshot.sampleable
    if not live:
        raise ValueError("collect_batch needs at least one sampleable (ACTIVE or RETIRING) adapter")
    groups: list[Group] = []
    counts: dict[str, int] = {}
    collected = 0
    started = last_arrival = last_warning = clock()
    while collected < target_samples and not _all_satisfied(snapshot, counts):
        buffers.raise_if_failed()
        for group in buffers.get_groups(snapshot, target_samples - collected, counts):
            groups.append(group)
            counts[group.adapter] = counts.get(group.adapter, 0) + 1
            collected += group.size
            last_arrival = clock()
        now = clock()
        if groups and now - last_arrival >= coalesce_wait_s:
            break
        if not groups and now - started >= empty_wait_s:
            raise EmptyBatchTimeoutError(f"no trainable group for {empty_wait_s:g} s from {sorted(live)}")
        if now - last_warning >= WARN_EVERY_S:
            log.warning("waiting for groups: %d/%d samples after %.0f s", collected, target_samples, now - started)
            last_warning = now
        await asyncio.sleep(poll_s)
    return build_batch(snapshot, groups, counts)


def _all_satisfied(snapshot: RegistrySnapshot, counts: dict[str, int]) -> bool:
    """Every live adapter has all the groups it needs for its step: waiting longer cannot add any."""
    return all(counts.get(name, 0) >= run.remaining_groups for name, run in snapshot.sampleable.items())


def build_batch(snapshot: RegistrySnapshot, groups: list[Group], counts: dict[str, int]) -> TrainBatch:
    live = snapshot.sampleable
    stepping = sorted((live[name].slot, name) for name, count in counts.items() if count == live[name].remaining_groups)
    return TrainBatch(
        groups=sorted(groups, key=lambda group: (group.slot, group.index)),
        group_counts=counts,
        step_names=[name for _, name in stepping],
        step_slots=[slot for slot, _ in stepping],
    )
