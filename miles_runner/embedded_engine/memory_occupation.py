"""SGLang's release/resume_memory_occupation for the embedded engine: what a colocated run's engines give back while
the trainer trains (docs/system.md §7: generate -> offload the rollout -> train -> onload the weights -> update the
weights -> onload the KV cache).

Read from SGLang 0.5.23 (`scheduler_components/weight_updater.py`, `utils/torch_memory_saver_adapter.py`,
`constants.py`) and kept:

- tags are `kv_cache`, `weights` and `cuda_graph`; none (or an empty list) means all three;
- a release needs the engine idle: nothing running, and nothing waiting unless generation is paused (a retract pause
  leaves its requests waiting, without KV). SGLang asserts it, which ends its scheduler; here it is a 400;
- `kv_cache` flushes the prefix cache, whether or not memory is saved;
- only with `--enable-memory-saver` is memory given back (without it SGLang's saver is a no-op): the KV cache's
  tensors and the base weights are freed, then the allocator returns the pages (malloc_trim: on a CPU host the
  process's resident memory drops by what was freed). `--enable-weights-cpu-backup` keeps the weights to restore
  from, which on a CPU host is their own memory: nothing of them is freed. Adapters stay, as SGLang's LoRA buffers
  lie outside its saver's weights region;
- resuming a tag that is not released is refused (SGLang's set.remove raises, ending its scheduler).

Where SGLang leaves the outcome to the hardware this engine picks the safe one: a request that arrives while memory
is released waits, as at a pause, and runs once every tag is resumed (SGLang would run it on unmapped memory: an
illegal memory access on a GPU); a base weight update is refused until the weights are resumed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_runner.core.host_memory import return_freed_pages, rss_bytes
from miles_runner.core.sglang_protocol import KV_CACHE_TAG, MEMORY_TAGS, WEIGHTS_TAG
from miles_runner.embedded_engine.model_runner import ModelRunner
from miles_runner.embedded_engine.prefix_cache import PrefixCache

NOT_IDLE = "release_memory_occupation should be called only when server is idle."


def checked_tags(tags: Sequence[str] | None) -> list[str]:
    """The tags a body names, all three where it names none; an unknown one is refused, naming the known ones."""
    if not tags:
        return list(MEMORY_TAGS)
    if unknown := [tag for tag in tags if tag not in MEMORY_TAGS]:
        raise ValueError(f"tags: unknown memory tag(s) {unknown}; the tags are {', '.join(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))


@dataclass
class MemoryOccupation:
    """What is released now, and the bytes each release freed (for /server_info and the run's offload figures)."""

    runner: ModelRunner
    prefix_cache: PrefixCache | None
    memory_saver: bool  # --enable-memory-saver: memory is really given back
    weights_cpu_backup: bool  # --enable-weights-cpu-backup
    released: set[str] = field(default_factory=set)
    freed_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def holds_requests(self) -> bool:
        """Whether requests must wait: the weights or the KV cache they would run on are given back."""
        return self.memory_saver and bool(self.released & {KV_CACHE_TAG, WEIGHTS_TAG})

    def release(self, tags: Sequence[str] | None) -> None:
        """Release `tags` (the caller has checked that the engine is idle)."""
        for tag in checked_tags(tags):
            if tag in self.released:
                continue
            self.released.add(tag)
            self.freed_bytes[tag] = self._release(tag)
        return_freed_pages()

    def resume(self, tags: Sequence[str] | None, model_path: str) -> None:
        wanted = checked_tags(tags)
        if not_released := [tag for tag in wanted if tag not in self.released]:
            raise ValueError(f"tags: {not_released} not released; released now: {sorted(self.released) or 'none'}")
        for tag in wanted:
            if tag == WEIGHTS_TAG and self.runner.weights_released:
                self.runner.resume_weights(model_path)
            self.released.discard(tag)
            self.freed_bytes.pop(tag, None)

    def _release(self, tag: str) -> int:
        if tag == KV_CACHE_TAG and self.prefix_cache is not None:
            freed = self.prefix_cache.nbytes
            self.prefix_cache.clear()  # SGLang flushes its cache on every kv_cache release
            return freed if self.memory_saver else 0
        if tag == WEIGHTS_TAG and self.memory_saver:
            return self.runner.release_weights(keep_backup=self.weights_cpu_backup)
        return 0  # cuda_graph: none on CPU; without the memory saver, nothing is given back

    def state(self) -> dict[str, object]:
        """What is released, the bytes each tag freed, and the process's resident memory now (what a release and a
        resume move)."""
        return {"released": sorted(self.released), "freed_bytes": dict(self.freed_bytes), "rss_bytes": rss_bytes()}
