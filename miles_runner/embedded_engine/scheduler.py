"""The engine's batching loop: one worker thread owns the model and every request's state.

The asyncio side only enqueues (requests, commands) and awaits futures, so ``/health``, ``/abort_request``
and ``/pause_generation`` answer while a batch is generating. Each loop iteration:

1. drain the inbox (new requests join the waiting queue; commands run between two steps);
2. run deferred commands whose moment has come (weight updates once idle, adapter unloads once unused);
3. admit waiting requests (``--max-running-requests``, ``--max-loras-per-batch`` distinct adapters), each starting
   from the longest prefix of its tokens in the prefix cache (``prefix_cache.py``; off with
   ``--disable-radix-cache``);
4. one step for every running request: prefills in one ragged forward, decodes in another. A request that
   finishes leaves its KV in the prefix cache.

Requests that arrive within a few milliseconds of each other start in the same prefill batch.

Pause modes, with SGLang's meaning:
- ``abort``: every waiting and running request returns now with ``finish_reason.type == "abort"``;
- ``in_place``: nothing steps; running requests keep their KV cache and resume from it on continue;
- ``retract``: running requests drop their KV cache and go back to the front of the waiting queue; on
  continue they are recomputed (``num_retractions`` counts it) and finish normally.
New requests are held by the HTTP layer's pause gate, before they reach this queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from miles_runner.embedded_engine.detokenizer import Detokenizer
from miles_runner.embedded_engine.memory_occupation import NOT_IDLE, MemoryOccupation
from miles_runner.embedded_engine.model_runner import ModelRunner
from miles_runner.embedded_engine.prefix_cache import BLOCK, PrefixCache
from miles_runner.embedded_engine.request import ReqState

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "in_place", "retract")
GATHER_WINDOW_S = 0.003  # how long an idle engine waits for simultaneous arrivals before a prefill
IDLE_POLL_S = 0.05


@dataclass
class _Deferred:
    """A command that runs once ``ready()`` holds; ``blocks_admission`` keeps new requests waiting meanwhile."""

    ready: Callable[[], bool]
    fn: Callable[[], Any]
    future: asyncio.Future
    blocks_admission: bool


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        detok: Detokenizer,
        *,
        pad_id: int,
        context_length: int,
        max_running_requests: int,
        max_loras_per_batch: int,
        weight_version: str,
        prefix_cache: PrefixCache | None = None,
        memory_saver: bool = False,
        weights_cpu_backup: bool = False,
    ) -> None:
        self.runner = runner
        self.prefix_cache = prefix_cache
        self.memory = MemoryOccupation(runner, prefix_cache, memory_saver, weights_cpu_backup)
        self.detok = detok
        self.pad_id = pad_id
        self.context_length = context_length
        self.max_running = max_running_requests
        self.max_loras_per_batch = max_loras_per_batch
        self.weight_version = weight_version
        self.paused_mode: str | None = None
        self._waiting: deque[ReqState] = deque()
        self._running: list[ReqState] = []
        self._deferred: list[_Deferred] = []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop  # the server's, given to start()
        self._thread = threading.Thread(target=self._work, name="embedded-engine-worker", daemon=True)

    # ----- called from the event loop ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def request_stop(self) -> None:
        """Make the worker abort every request and exit (thread-safe, returns at once)."""
        self._stopping = True
        self._inbox.put(None)

    def stop(self, timeout: float = 5.0) -> None:
        self.request_stop()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(self, state: ReqState) -> None:
        self._inbox.put(state)

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run ``fn`` on the worker thread between two steps; the future gets its result or exception."""
        return self._defer(lambda: True, fn, blocks_admission=False)

    def call_when_idle(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run ``fn`` once nothing is running (or the engine is paused): SGLang's weight-update lock."""
        return self._defer(lambda: self.paused_mode is not None or not self._running, fn, blocks_admission=True)

    def call_when_unused(self, adapter: str, fn: Callable[[], Any]) -> asyncio.Future:
        """Run ``fn`` once no waiting or running request uses ``adapter`` (unloading it)."""
        return self._defer(lambda: not self._uses_adapter(adapter), fn, blocks_admission=False)

    def _defer(self, ready, fn, *, blocks_admission: bool) -> asyncio.Future:
        future = self._loop.create_future()
        self._inbox.put(_Deferred(ready, fn, future, blocks_admission))
        return future

    # ----- commands (they run on the worker thread) -----------------------------------------------------------
    def abort_matching(self, match: Callable[[str], bool], message: str = "Abort request.") -> int:
        aborted = 0
        for state in [s for s in self._waiting if match(s.rid)]:
            self._waiting.remove(state)
            state.abort("Abort in waiting queue")
            self._deliver(state, in_queue_abort=state.kv_len == 0 and not state.output_ids)
            aborted += 1
        for state in [s for s in self._running if match(s.rid)]:
            self._running.remove(state)
            state.abort(message)
            self._deliver(state)
            aborted += 1
        return aborted

    def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused_mode = mode
        if mode == "abort":
            self.abort_matching(lambda _rid: True, "Abort by pause_generation.")
        elif mode == "retract":
            for state in reversed(self._running):
                state.retract()
                self._waiting.appendleft(state)
            self._running.clear()

    def resume(self) -> None:
        self.paused_mode = None

    def flush_prefix_cache(self) -> bool:
        """SGLang's /flush_cache: drop every cached prefix; refused (False) while requests hold or await KV."""
        if self.holds_requests():
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return True

    def release_memory(self, tags: list[str] | None) -> None:
        """SGLang's release_memory_occupation (memory_occupation.py), refused unless the engine is idle."""
        if self._running or (self._waiting and self.paused_mode is None):
            raise ValueError(NOT_IDLE)
        self.memory.release(tags)

    def resume_memory(self, tags: list[str] | None, model_path: str) -> None:
        self.memory.resume(tags, model_path)

    def holds_requests(self) -> bool:
        """Whether a cache flush must be refused: requests resident (in_place) or still to run."""
        if self.paused_mode is not None:
            return bool(self._running)
        return bool(self._running or self._waiting)

    def load(self) -> dict[str, object]:
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting),
            "memory_occupation": self.memory.state(),
        }

    def _uses_adapter(self, adapter: str) -> bool:
        return any(s.req.adapter == adapter for s in (*self._running, *self._waiting))

    # ----- the worker loop -----------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stopping:
            was_idle = not self._running
            self._drain_inbox(block=not self._has_work())
            if was_idle and self._waiting and self._can_admit():
                time.sleep(GATHER_WINDOW_S)
                self._drain_inbox(block=False)
            self._run_ready_deferred()
            if self._can_admit():
                self._admit()
            if self._running and self.paused_mode is None:
                self._step_safely()
        self._shutdown_requests()

    def _has_work(self) -> bool:
        steppable = bool(self._running) and self.paused_mode is None
        admissible = bool(self._waiting) and self._can_admit()
        return steppable or admissible or any(d.ready() for d in self._deferred)

    def _drain_inbox(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Deferred):
                self._deferred.append(item)
            else:
                self._waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run_ready_deferred(self) -> None:
        for deferred in [d for d in self._deferred if d.ready()]:
            self._deferred.remove(deferred)
            try:
                outcome, failed = deferred.fn(), None
            except Exception as exc:  # reported to the caller, who turns it into an HTTP error
                outcome, failed = None, exc
            self._loop.call_soon_threadsafe(settle_future, deferred.future, outcome, failed)

    def _can_admit(self) -> bool:
        return (
            self.paused_mode is None
            and not self.memory.holds_requests
            and not any(d.blocks_admission for d in self._deferred)
        )

    def _admit(self) -> None:
        adapters = {s.req.adapter for s in self._running} - {None}
        for state in list(self._waiting):
            if len(self._running) >= self.max_running:
                return
            adapter = state.req.adapter
            if adapter is not None and adapter not in adapters and len(adapters) >= self.max_loras_per_batch:
                continue
            if adapter is not None:
                adapters.add(adapter)
            self._waiting.remove(state)
            self._running.append(state)
            if state.kv_len == 0:
                self._start_from_prefix_cache(state)

    def _namespace(self, state: ReqState) -> tuple:
        adapter = state.req.adapter
        return state.req.extra_key, adapter, self.runner.kv_generation(adapter)

    def _start_from_prefix_cache(self, state: ReqState) -> None:
        if self.prefix_cache is None:
            return
        state.cache_namespace = self._namespace(state)
        length, prefix = self.prefix_cache.match(state.cache_namespace, state.tokens, state.prefix_limit())
        if prefix is not None:
            state.start_from(length, prefix)

    def _keep_prefix(self, state: ReqState) -> None:
        """Leave a finished request's KV in the prefix cache, unless the weights changed since it was admitted
        (its KV would mix two versions), it was aborted, or the cache already holds all but less than a block of
        its tokens (the other samples of a group: one copy of their prompt is enough)."""
        if (
            self.prefix_cache is None
            or state.cache is None
            or state.finish_reason is None
            or state.finish_reason.get("type") == "abort"
            or state.cache_namespace != self._namespace(state)
        ):
            return
        tokens = state.tokens[: state.kv_len]
        if state.kv_len - self.prefix_cache.match(state.cache_namespace, tokens, state.kv_len)[0] < BLOCK:
            return
        routing = np.concatenate(state.routing_chunks) if state.routing_chunks else None
        if self.runner.is_moe and (routing is None or len(routing) != state.kv_len):
            return  # a later request's routed experts would miss rows
        self.prefix_cache.insert(state.cache_namespace, tokens, state.cache, routing, replaces=state.prefix)

    def _step_safely(self) -> None:
        try:
            self._step()
        except Exception as exc:  # a bug outside any one request's work must not kill the engine: fail the batch
            logger.exception("generation step failed")
            for state in self._running:
                state.abort(f"Internal error during generation: {exc}", status_code=500)
                self._deliver(state)
            self._running.clear()

    def _step(self) -> None:
        prefill = [s for s in self._running if len(s.tokens) - s.kv_len > 1]
        decode = [s for s in self._running if len(s.tokens) - s.kv_len == 1]
        for group in (prefill, decode):
            if group:
                self._advance(group)
        for state in list(self._running):
            if state.finish_reason is not None:
                self._running.remove(state)
                self._keep_prefix(state)
                self._deliver(state)
            elif state.req.stream:
                self._deliver(state)

    def _advance(self, group: list[ReqState]) -> None:
        """One forward and one sampled token for each request of ``group``. A failure fails only the request it
        belongs to: a batched forward that raises is retried row by row (forwards leave the rows' caches as they
        were), and each request samples on its own, so the requests beside a bad one finish normally."""
        try:
            outputs = self.runner.forward([s.row_input() for s in group], self.pad_id)
        except Exception as exc:
            if len(group) == 1:
                _fail(group[0], exc)
                return
            logger.exception("a batched forward of %d requests failed; retrying them one by one", len(group))
            for state in group:
                self._advance([state])
            return
        for state, output in zip(group, outputs, strict=True):
            try:
                logits = state.absorb_forward(output, self.detok)
                state.append_token(state.sample(logits, self.detok.eos_token_ids), self.detok, self.context_length)
            except Exception as exc:
                _fail(state, exc)

    def _deliver(self, state: ReqState, *, in_queue_abort: bool = False) -> None:
        result = state.result(self.detok, self.weight_version, in_queue_abort=in_queue_abort)
        self._loop.call_soon_threadsafe(state.sink, result)

    def _shutdown_requests(self) -> None:
        self.abort_matching(lambda _rid: True, "The server is shutting down.")
        for deferred in self._deferred:
            self._loop.call_soon_threadsafe(settle_future, deferred.future, None, RuntimeError("server shutting down"))


def _fail(state: ReqState, exc: Exception) -> None:
    """End one request with SGLang's internal-error abort (a 500 for it alone); the step removes and delivers it."""
    logger.error("request %s failed during generation: %r", state.rid, exc, exc_info=exc)
    state.abort(f"Internal error during generation: {exc}", status_code=500)


def settle_future(future: asyncio.Future, outcome: Any, failed: BaseException | None) -> None:
    if future.done():
        return
    if failed is not None:
        future.set_exception(failed)
    else:
        future.set_result(outcome)
