"""Per-adapter group buffers and the round-robin selection of train groups (docs/system.md §4.6).

The producer puts finished groups in; the batch collector takes them out with `get_groups`, in whole
`min_groups_per_dp_split` chunks, round-robin over the live adapters (the rotation persists across calls),
and never more than an adapter still needs before its next optimizer step. Groups of a previous tenant of a
reused name (another registration id), of adapters that are no longer sampleable, or stamped with a slot
version more than `max_staleness` behind are dropped and counted, never trained on.

Producer and collector share one event loop and none of these methods awaits, so each runs atomically.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from miles_runner.core.adapters import min_groups_per_dp_split
from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot
from miles_runner.session.samples import Sample

DEFAULT_MAX_GROUPS = 1000


@dataclass
class Group:
    """One prompt's samples, stamped at submission with what they were generated under."""

    adapter: str
    index: int  # the producer's per-adapter sequence number
    samples: list[Sample]
    slot: int
    slot_version: int | None = None  # None: unstamped (kept by every filter)
    registration_id: str = ""  # "": unstamped

    @property
    def size(self) -> int:
        return len(self.samples)


class GroupBuffer:
    """A bounded FIFO of one adapter's groups; when full, the oldest group is dropped to make room."""

    def __init__(self, maxlen: int = DEFAULT_MAX_GROUPS) -> None:
        self._groups: deque[Group] = deque(maxlen=maxlen)
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._groups)

    def put(self, group: Group) -> None:
        if len(self._groups) == self._groups.maxlen:
            self.overflowed += 1
        self._groups.append(group)

    def get(self, n: int) -> list[Group]:
        """Pop the oldest `n` groups (fewer if there are fewer)."""
        return [self._groups.popleft() for _ in range(min(n, len(self._groups)))]

    def drop_foreign(self, registration_id: str) -> int:
        """Drop groups stamped with another registration; returns how many."""
        return self._drop(lambda g: bool(g.registration_id) and g.registration_id != registration_id)

    def drop_stale(self, version: int, max_staleness: int | None) -> int:
        """Drop groups generated more than `max_staleness` weight versions ago (None: keep all)."""
        if max_staleness is None:
            return 0
        return self._drop(lambda g: g.slot_version is not None and version - g.slot_version > max_staleness)

    def _drop(self, doomed) -> int:
        kept = [g for g in self._groups if not doomed(g)]
        dropped = len(self._groups) - len(kept)
        self._groups = deque(kept, maxlen=self._groups.maxlen)
        return dropped


class AdapterBuffers:
    """Every adapter's GroupBuffer, the selection rotation, drop counts, and the producer's fate."""

    def __init__(self, dp_size: int, max_staleness: int | None, maxlen: int = DEFAULT_MAX_GROUPS) -> None:
        self.dp_size = dp_size
        self.max_staleness = max_staleness
        self.maxlen = maxlen
        self.buffers: dict[str, GroupBuffer] = {}
        self.rotation: deque[str] = deque()
        self.dropped: Counter[tuple[str, str]] = Counter()  # (adapter, reason) -> groups
        self.failure: BaseException | None = None

    # ---- producer side ------------------------------------------------------------------------------

    def put(self, group: Group) -> None:
        self.buffers.setdefault(group.adapter, GroupBuffer(self.maxlen)).put(group)

    def buffered(self, adapter: str) -> int:
        buffer = self.buffers.get(adapter)
        return len(buffer) if buffer else 0

    def count_drop(self, adapter: str, reason: str, groups: int = 1) -> None:
        if groups:
            self.dropped[adapter, reason] += groups

    def fail(self, error: BaseException) -> None:
        """The producer died: every later collect raises with this as its cause."""
        self.failure = error

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"the multi-LoRA producer died: {self.failure!r}") from self.failure

    # ---- collector side -----------------------------------------------------------------------------

    def get_groups(self, snapshot: RegistrySnapshot, want_samples: int, group_counts: Mapping[str, int]) -> list[Group]:
        """Up to `want_samples` samples (possibly one chunk over) of trainable groups, round-robin in
        whole dp chunks; `group_counts` are the groups of this batch already taken per adapter."""
        live = snapshot.sampleable
        self._forget_departed(live)
        self._sync_rotation(live)
        counts = dict(group_counts)
        taken: list[Group] = []
        taken_samples = 0
        while taken_samples < want_samples:
            chunk = self._next_chunk(live, counts)
            if not chunk:
                break
            counts[chunk[0].adapter] = counts.get(chunk[0].adapter, 0) + len(chunk)
            taken += chunk
            taken_samples += sum(group.size for group in chunk)
        return taken

    def _forget_departed(self, live: Mapping[str, AdapterRun]) -> None:
        """Drop the buffers of adapters no longer sampleable. (A name re-registered since its groups were made
        keeps its buffer, but every group stamped with the old registration id is dropped as foreign.)"""
        for name in [name for name in self.buffers if name not in live]:
            self.count_drop(name, "retired", len(self.buffers.pop(name)))

    def _sync_rotation(self, live: Mapping[str, AdapterRun]) -> None:
        """Names already in the rotation keep their order; new ones join at the end, sorted."""
        kept = [name for name in self.rotation if name in live]
        self.rotation = deque(kept + sorted(set(live) - set(kept)))

    def _next_chunk(self, live: Mapping[str, AdapterRun], counts: Mapping[str, int]) -> list[Group]:
        """One pass over the rotation from its cursor: the first adapter with a trainable chunk yields it."""
        for _ in range(len(self.rotation)):
            name = self.rotation[0]
            self.rotation.rotate(-1)
            chunk = self._pop_chunk(live[name], counts.get(name, 0))
            if chunk:
                return chunk
        return []

    def _pop_chunk(self, run: AdapterRun, already_taken: int) -> list[Group]:
        buffer = self.buffers.get(run.name)
        if buffer is None:
            return []
        self.count_drop(run.name, "foreign", buffer.drop_foreign(run.registration_id))
        self.count_drop(run.name, "stale", buffer.drop_stale(run.version, self.max_staleness))
        if run.remaining_groups <= 0:
            raise RuntimeError(f"adapter {run.name} has {run.accumulated_groups} groups accumulated, past its step")
        chunk = min_groups_per_dp_split(run.config.n_samples_per_prompt, self.dp_size)
        if chunk is None:
            raise ValueError(f"adapter {run.name}: n_samples_per_prompt and dp {self.dp_size} do not divide")
        allowed = run.remaining_groups - already_taken
        take = min(chunk, len(buffer) // chunk * chunk, allowed)
        return buffer.get(take) if take > 0 else []
