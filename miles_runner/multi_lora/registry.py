"""The adapter registry (docs/system.md §4.2): which adapter holds which engine slot, in which lifecycle state.

PENDING (registered, weights not yet on the engines) -> ACTIVE (sampled and trained) -> RETIRING (asked to
stop; still sampled and trained until the driver reconciles) -> CLEANUP (its requests aborted; the trainer
is releasing its slot) -> COMPLETED (the slot is free again). Every state but COMPLETED holds its slot.

Two counters make stale data detectable downstream: `slot_versions[slot]` grows with every weight push to the
slot and is never reset, so a (slot, version) pair never recurs across tenants; and every registration gets
a fresh `registration_id`, so groups generated for an earlier tenant of a reused name can be told apart.

`mark_batch_trained` is the only place steps and accumulated groups advance, so a train call that fails
(and therefore never reports its batch) changes nothing. Pure and synchronous: the controller owns one.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from miles_runner.core.adapters import adapter_name_problem, slot_lora_name
from miles_runner.multi_lora.config import AdapterRunConfig

log = logging.getLogger(__name__)

MAX_BATCH_RECORDS = 16
MAX_COMPLETED_RECORDS = 1024


class AdapterState(StrEnum):
    PENDING = "PENDING"
    ACTIVE = "ACTIVE"
    RETIRING = "RETIRING"
    CLEANUP = "CLEANUP"
    COMPLETED = "COMPLETED"


class NoFreeSlotError(RuntimeError):
    """Every slot is held by a live adapter (the API answers 409)."""


class UnknownAdapterError(KeyError):
    """No live record under this name (the API answers 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown adapter"


@dataclass
class AdapterRecord:
    name: str
    slot: int
    config: AdapterRunConfig
    step: int = 0
    start_step: int = 0  # the step it (re)started from; num_step counts from here
    accumulated_groups: int = 0  # groups trained since its last optimizer step
    state: AdapterState = AdapterState.PENDING
    registration_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class AdapterRun:
    """A read-only view of one adapter for samplers and batchers (docs/system.md §4.1)."""

    name: str
    config: AdapterRunConfig
    slot: int
    version: int = 0
    step: int = 0
    accumulated_groups: int = 0
    registration_id: str = ""

    @property
    def lora_name(self) -> str:
        """The engine slot it decodes with (and the trainer's peft adapter name)."""
        return slot_lora_name(self.slot)

    @property
    def remaining_groups(self) -> int:
        """Groups still needed before its next optimizer step."""
        return self.config.rollout_batch_size - self.accumulated_groups

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "config": self.config.to_dict(),
            "slot": self.slot,
            "version": self.version,
            "step": self.step,
            "accumulated_groups": self.accumulated_groups,
            "registration_id": self.registration_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AdapterRun:
        return cls(**{**data, "config": AdapterRunConfig.from_dict(data["config"])})


@dataclass(frozen=True)
class RegistrySnapshot:
    pending: dict[str, AdapterRun] = field(default_factory=dict)
    active: dict[str, AdapterRun] = field(default_factory=dict)
    retiring: dict[str, AdapterRun] = field(default_factory=dict)
    cleanup: tuple[str, ...] = ()
    completed: tuple[str, ...] = ()

    @property
    def sampleable(self) -> dict[str, AdapterRun]:
        """Adapters whose weights are on the engines and that still train: ACTIVE and RETIRING."""
        return {**self.active, **self.retiring}

    @property
    def has_work(self) -> bool:
        """Anything left for the driver to load, train or clean up."""
        return bool(self.pending or self.active or self.retiring or self.cleanup)

    def to_dict(self) -> dict[str, Any]:
        runs = {state: {n: r.to_dict() for n, r in getattr(self, state).items()} for state in _RUN_STATES}
        return {**runs, "cleanup": list(self.cleanup), "completed": list(self.completed)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RegistrySnapshot:
        runs = {state: {n: AdapterRun.from_dict(r) for n, r in data[state].items()} for state in _RUN_STATES}
        return cls(**runs, cleanup=tuple(data["cleanup"]), completed=tuple(data["completed"]))


_RUN_STATES = ("pending", "active", "retiring")


@dataclass(frozen=True)
class BatchRecord:
    group_counts: dict[str, int]
    step_names: tuple[str, ...]


class AdapterRegistry:
    def __init__(self, max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"a multi-LoRA registry needs at least one slot, got {max_slots}")
        self.max_slots = max_slots
        self.free_slots: set[int] = set(range(max_slots))
        self.slot_versions: list[int] = [0] * max_slots
        self._records: dict[str, AdapterRecord] = {}  # every state but COMPLETED
        self._completed: OrderedDict[str, AdapterRecord] = OrderedDict()
        self._batches: OrderedDict[str, BatchRecord] = OrderedDict()

    # ---- lifecycle ----------------------------------------------------------------------------------

    def register(self, name: str, config: AdapterRunConfig) -> dict[str, Any]:
        problem = adapter_name_problem(name)
        if problem:
            raise ValueError(problem)
        live = self._records.get(name)
        if live is not None and live.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            raise ValueError(f"adapter '{name}' is already registered")
        if live is not None:
            raise ValueError(f"adapter '{name}' is {live.state}: still cleaning up; retry shortly")
        holder = next((r.name for r in self._records.values() if r.config.save == config.save), None)
        if holder is not None:
            raise ValueError(f"save folder {config.save!r} is already used by live adapter '{holder}'")
        if not self.free_slots:
            raise NoFreeSlotError(f"No free adapter slots (max {self.max_slots})")
        slot = min(self.free_slots)
        self.free_slots.remove(slot)
        self._completed.pop(name, None)
        self._records[name] = AdapterRecord(name=name, slot=slot, config=config)
        return {"name": name, "slot": slot}

    def deregister(self, name: str) -> AdapterState:
        """Mark a PENDING/ACTIVE adapter RETIRING (it keeps sampling and training until reconciled)."""
        record = self._live(name)
        if record.state in (AdapterState.PENDING, AdapterState.ACTIVE):
            record.state = AdapterState.RETIRING
        return record.state

    def retire_adapters(self) -> list[str]:
        """RETIRING -> CLEANUP for every retiring adapter; the caller aborts their requests."""
        retired = sorted(r.name for r in self._records.values() if r.state is AdapterState.RETIRING)
        for name in retired:
            self._records[name].state = AdapterState.CLEANUP
        return retired

    def free_slot(self, name: str) -> int:
        """Release a CLEANUP adapter's slot and complete it; -1 (and nothing changes) in any other state."""
        record = self._records.get(name)
        if record is None or record.state is not AdapterState.CLEANUP:
            return -1
        del self._records[name]
        record.state = AdapterState.COMPLETED
        self.free_slots.add(record.slot)
        self._completed[name] = record
        while len(self._completed) > MAX_COMPLETED_RECORDS:
            self._completed.popitem(last=False)
        return record.slot

    def record_weight_update(self, names: Iterable[str]) -> None:
        """The named adapters' weights were pushed to their slots: bump those slots' versions; PENDING -> ACTIVE."""
        for record in [self._live(name) for name in names]:  # all known, or nothing changes
            self.slot_versions[record.slot] += 1
            if record.state is AdapterState.PENDING:
                record.state = AdapterState.ACTIVE

    # ---- batches and steps --------------------------------------------------------------------------

    def record_batch_adapters(
        self, rollout_id: str, group_counts: Mapping[str, int], step_names: Iterable[str]
    ) -> None:
        steps = tuple(step_names)
        unknown = sorted(set(steps) - set(group_counts))
        if unknown:
            raise ValueError(f"step adapters {unknown} have no groups in batch {rollout_id!r}")
        self._batches[rollout_id] = BatchRecord(dict(group_counts), steps)
        while len(self._batches) > MAX_BATCH_RECORDS:
            self._batches.popitem(last=False)

    def mark_batch_trained(self, rollout_id: str) -> list[str]:
        """Commit a trained batch: accumulate its groups, step the adapters that completed a batch, retire
        those that reached num_step. Returns the names that stepped."""
        batch = self._batches.pop(rollout_id, None)
        if batch is None:
            raise UnknownAdapterError(f"no batch recorded under rollout id {rollout_id!r}")
        trains = (AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP)
        for name, count in batch.group_counts.items():
            record = self._records.get(name)
            if record is not None and record.state in trains:
                record.accumulated_groups += count
        stepped = [name for name in batch.step_names if name in self._records]
        for name in stepped:
            self._step(self._records[name])
        return stepped

    def _step(self, record: AdapterRecord) -> None:
        if record.accumulated_groups != record.config.rollout_batch_size:
            log.warning(
                "adapter %s stepped with %d groups, expected %d",
                record.name,
                record.accumulated_groups,
                record.config.rollout_batch_size,
            )
        record.step += 1
        record.accumulated_groups = 0
        num_step = record.config.num_step
        if record.state is AdapterState.ACTIVE and num_step and record.step - record.start_step >= num_step:
            record.state = AdapterState.RETIRING

    def resolve_num_step(self, name: str, rows: int) -> int:
        """num_step from the data size when unset: (num_epoch or 1) * rows // rollout_batch_size, at least 1."""
        record = self._live(name)
        config = record.config
        if config.num_step is not None:
            return config.num_step
        num_step = max(1, (config.num_epoch or 1) * rows // config.rollout_batch_size)
        record.config = replace(config, num_step=num_step)
        return num_step

    def set_step(self, name: str, step: int) -> None:
        """Resume: the adapter continues from `step`, and num_step counts from there."""
        record = self._live(name)
        record.step = record.start_step = step

    def adapter_step(self, name: str) -> int:
        return self._live(name).step

    # ---- views --------------------------------------------------------------------------------------

    def active_adapters(self) -> list[str]:
        keep = (AdapterState.ACTIVE, AdapterState.RETIRING)
        return sorted(r.name for r in self._records.values() if r.state in keep)

    def snapshot(self) -> RegistrySnapshot:
        def runs(state: AdapterState) -> dict[str, AdapterRun]:
            return {r.name: self._view(r) for r in sorted(self._records.values(), key=_by_slot) if r.state is state}

        return RegistrySnapshot(
            pending=runs(AdapterState.PENDING),
            active=runs(AdapterState.ACTIVE),
            retiring=runs(AdapterState.RETIRING),
            cleanup=tuple(sorted(r.name for r in self._records.values() if r.state is AdapterState.CLEANUP)),
            completed=tuple(self._completed),
        )

    def state_of(self, name: str) -> AdapterState | None:
        record = self._records.get(name) or self._completed.get(name)
        return record.state if record else None

    def status(self, name: str) -> dict[str, Any]:
        """The API's view of one adapter, live or completed."""
        record = self._records.get(name) or self._completed.get(name)
        if record is None:
            raise UnknownAdapterError(f"no adapter named '{name}'")
        completed = record.state is AdapterState.COMPLETED
        return {
            "name": record.name,
            "slot": record.slot,
            "version": None if completed else self.slot_versions[record.slot],
            "step": record.step,
            "accumulated_groups": record.accumulated_groups,
            "registration_id": record.registration_id,
            **record.config.to_dict(),
            "state": str(record.state),
        }

    def statuses(self) -> list[dict[str, Any]]:
        records = [*sorted(self._records.values(), key=_by_slot), *self._completed.values()]
        return [self.status(r.name) for r in records]

    def _view(self, record: AdapterRecord) -> AdapterRun:
        return AdapterRun(
            name=record.name,
            config=record.config,
            slot=record.slot,
            version=self.slot_versions[record.slot],
            step=record.step,
            accumulated_groups=record.accumulated_groups,
            registration_id=record.registration_id,
        )

    def _live(self, name: str) -> AdapterRecord:
        record = self._records.get(name)
        if record is None:
            raise UnknownAdapterError(f"no live adapter named '{name}'")
        return record


def _by_slot(record: AdapterRecord) -> int:
    return record.slot
