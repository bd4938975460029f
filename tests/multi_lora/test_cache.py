"""AdaptersCache: one snapshot per TTL for the hot path; a failed refresh keeps the last good one."""

from __future__ import annotations

from miles_runner.multi_lora.cache import AdaptersCache
from miles_runner.multi_lora.registry import RegistrySnapshot

from .helpers import run, snapshot


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Source:
    """Snapshots served in turn; `fail` makes the next fetch raise (an injected fault)."""

    def __init__(self, *snapshots: RegistrySnapshot) -> None:
        self.snapshots = list(snapshots)
        self.fetches = 0
        self.fail = False

    async def __call__(self) -> RegistrySnapshot:
        self.fetches += 1
        if self.fail:
            raise ConnectionError("controller unreachable")
        return self.snapshots[min(self.fetches, len(self.snapshots)) - 1]


async def test_lookups_within_the_ttl_share_one_fetch():
    source, clock = Source(snapshot(run("a", 0))), Clock()
    cache = AdaptersCache(source, ttl_s=1.0, clock=clock)
    for _ in range(5):
        await cache.get("a")
        clock.now += 0.1
    assert source.fetches == 1


async def test_a_lookup_after_the_ttl_refreshes():
    source, clock = Source(snapshot(run("a", 0)), snapshot()), Clock()
    cache = AdaptersCache(source, ttl_s=1.0, clock=clock)
    assert await cache.get("a") is not None
    clock.now = 1.0
    assert await cache.get("a") is None


async def test_a_failed_refresh_keeps_the_last_good_snapshot():
    source, clock = Source(snapshot(run("a", 0))), Clock()
    cache = AdaptersCache(source, ttl_s=1.0, clock=clock)
    await cache.get("a")
    source.fail, clock.now = True, 5.0
    assert (await cache.get("a")).name == "a"
    assert source.fetches == 2


async def test_before_any_good_snapshot_nothing_is_sampleable():
    source = Source()
    source.fail = True
    assert await AdaptersCache(source).get_all() == {}


async def test_only_active_and_retiring_adapters_are_served():
    snap = RegistrySnapshot(pending={"p": run("p", 0)}, active={"a": run("a", 1)}, retiring={"r": run("r", 2)})
    cache = AdaptersCache(Source(snap))
    assert sorted(await cache.get_all()) == ["a", "r"]
