"""The embedded engine's prefix cache: SGLang's radix cache, for one process on CPU.

A finished request leaves its KV cache (and the expert routing of its tokens) here; a later request whose tokens
start with the same ones, under the same namespace, starts from that KV and prefills only the rest. An agent's
next turn re-sends its whole conversation, so most of each turn's prompt is served from here, as SGLang serves it
from its radix tree (`meta_info.cached_tokens` counts those tokens).

Rules taken from SGLang 0.5.23 (`schedule_batch.py`, `Req._compute_max_prefix_len` and the radix key):

- the namespace is the request's `extra_key` joined with its adapter (SGLang appends the adapter's `lora_id`);
  here it also carries the adapter's load generation, so KV computed under replaced weights is never reused;
- at most `len(input) - 1` tokens are matched (one token is always computed, for the next-token logits), and at
  most `logprob_start_len` when prompt logprobs are asked for (those positions need their logits).

Entries are indexed by a chained hash of each whole `BLOCK` of their tokens (as vLLM indexes its KV blocks); a lookup
finds the newest entry sharing the longest run of whole blocks, checks those tokens, then extends the match token by
token. The least recently used entries go when the cache holds more than `budget_bytes` of KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from miles_runner.embedded_engine.model_runner import KVCache

BLOCK = 16  # index granularity in tokens (a match itself is token-exact)
DEFAULT_BUDGET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class CachedPrefix:
    namespace: Hashable
    tokens: tuple[int, ...]
    kv: KVCache  # per layer its cached tensors, each (heads, len(tokens), dim), owned by the cache
    routing: np.ndarray | None  # (len(tokens), layers, top_k) expert ids of a MoE model, else None

    @property
    def nbytes(self) -> int:
        kv_bytes = sum(t.nbytes for states in self.kv for t in states)
        return kv_bytes + (self.routing.nbytes if self.routing is not None else 0)

    def head(self, length: int) -> tuple[KVCache, np.ndarray | None]:
        """The KV and routing of the first `length` tokens (views: the cache's tensors are never written)."""
        kv = [tuple(t[:, :length] for t in states) for states in self.kv]
        return kv, (self.routing[:length] if self.routing is not None else None)


class PrefixCache:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # id(entry) -> entry, least recent first
        self._index: dict[tuple[Hashable, int], CachedPrefix] = {}  # (namespace, chained block hash) -> entry
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def match(self, namespace: Hashable, tokens: Sequence[int], limit: int) -> tuple[int, CachedPrefix | None]:
        """The longest cached prefix of `tokens[:limit]` in `namespace`: (its length, its entry), or (0, None)."""
        hashes = _block_hashes(tokens[:limit])
        for blocks in range(len(hashes), 0, -1):
            entry = self._index.get((namespace, hashes[blocks - 1]))
            end = blocks * BLOCK
            if entry is not None and entry.tokens[:end] == tuple(tokens[:end]):  # not a hash collision
                length = end + _common_length(entry.tokens[end:], tokens[end:limit])
                self._entries.move_to_end(id(entry))
                return length, entry
        return 0, None

    def insert(
        self,
        namespace: Hashable,
        tokens: Sequence[int],
        kv: KVCache,
        routing: np.ndarray | None,
        replaces: CachedPrefix | None = None,
    ) -> None:
        """Keep a copy of `kv` (and `routing`) for `tokens`. `replaces`, the entry this request started from, is
        dropped: its tokens are a prefix of these, so every lookup it would answer this one answers as well."""
        if len(tokens) < BLOCK:
            return
        entry = CachedPrefix(
            namespace,
            tuple(tokens),
            [tuple(t.clone() for t in states) for states in kv],
            None if routing is None else routing[: len(tokens)].copy(),
        )
        if entry.nbytes > self.budget_bytes:
            return
        if replaces is not None and entry.tokens[: len(replaces.tokens)] == replaces.tokens:
            self._remove(replaces)
        self._entries[id(entry)] = entry
        self._bytes += entry.nbytes
        for block_hash in _block_hashes(entry.tokens):
            self._index[(namespace, block_hash)] = entry
        while self._bytes > self.budget_bytes:
            self._remove(next(iter(self._entries.values())))

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._bytes = 0

    def _remove(self, entry: CachedPrefix) -> None:
        if self._entries.pop(id(entry), None) is None:
            return
        self._bytes -= entry.nbytes
        for block_hash in _block_hashes(entry.tokens):
            key = (entry.namespace, block_hash)
            if self._index.get(key) is entry:  # a newer entry may hold this block now
                del self._index[key]


def _block_hashes(tokens: Sequence[int]) -> list[int]:
    """One hash per whole block, each over every token up to the block's end (chained)."""
    hashes, running = [], 0
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        running = hash((running, tuple(tokens[start : start + BLOCK])))
        hashes.append(running)
    return hashes


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
