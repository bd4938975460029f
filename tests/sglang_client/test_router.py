"""The real sglang-router (0.3.2) in front of two embedded engines.

The engines are told apart by `--weight-version`: every result reports the version of the engine that
served it, so no engine-side counter is needed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess, ProcessGroup, ProcessStartError
from miles_runner.sglang_client import response as res
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.router import STICKY_POLICY, list_workers, router_argv, worker_urls_of
from miles_testkit.contract import generate_payload
from miles_testkit.launch import engine_process, engine_url, start_router

from .engines import ENGINE_START_TIMEOUT_S, TEST_ENV, plain_engine_argv

pytestmark = pytest.mark.integration

ENGINE_NAMES = ("engine-a", "engine-b")


@pytest.fixture(scope="module")
def engine_pair(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    logs = tmp_path_factory.mktemp("router_engines")
    ports = [free_port() for _ in ENGINE_NAMES]
    argvs = [
        plain_engine_argv(tiny_moe_dir, p, "--weight-version", n) for p, n in zip(ports, ENGINE_NAMES, strict=True)
    ]
    with ProcessGroup() as group:
        engines = [
            group.adopt(
                engine_process(
                    argv, port=port, log_path=logs / f"{name}.log", env=TEST_ENV, timeout_s=ENGINE_START_TIMEOUT_S
                ).start()
            )
            for argv, port, name in zip(argvs, ports, ENGINE_NAMES, strict=True)
        ]
        for engine in engines:  # started together, so their start-ups overlap
            engine.wait_healthy()
        yield [engine_url(argv, port) for argv, port in zip(argvs, ports, strict=True)]


def router(engine_pair: list[str], tmp_path: Path, policy: str, *extra: str) -> tuple[ManagedProcess, str]:
    port = free_port()
    process = start_router(engine_pair, port=port, log_path=tmp_path / "router.log", policy=policy, extra=extra)
    return process, f"http://127.0.0.1:{port}"


async def served_by(client: EngineClient, routing_key: str | None = None) -> str:
    result = await client.generate(generate_payload(2), routing_key=routing_key)
    return str(res.weight_version(result))


def test_router_argv_binds_metrics_to_the_router_host() -> None:
    argv = router_argv("127.0.0.1", 8000, ["http://127.0.0.1:1"], "round_robin", metrics_port=8001)
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-port") + 1] == "8001"


def test_router_argv_rejects_policies_the_router_lacks() -> None:
    with pytest.raises(ValueError, match="round_robin"):
        router_argv("127.0.0.1", 8000, ["http://127.0.0.1:1"], "consistent_hashing", metrics_port=8001)


def test_worker_lists_parse_in_both_router_shapes() -> None:
    assert worker_urls_of({"workers": [{"url": "http://a:1/"}]}) == ["http://a:1"]
    assert worker_urls_of({"urls": ["http://b:2"]}) == ["http://b:2"]


async def test_router_spreads_requests_across_both_engines(engine_pair: list[str], tmp_path: Path) -> None:
    process, url = router(engine_pair, tmp_path, "round_robin")
    try:
        async with EngineClient(url) as client:
            counts = Counter([await served_by(client) for _ in range(8)])
        workers = await list_workers(url)
    finally:
        process.stop()
    assert counts == {"engine-a": 4, "engine-b": 4}
    assert sorted(workers) == sorted(engine_pair)


async def test_routing_key_keeps_each_session_on_one_engine(engine_pair: list[str], tmp_path: Path) -> None:
    # New keys go to a random engine (the manual policy's default assignment; its min_group/min_load modes
    # count only in-flight requests, so sequential requests tie): 16 keys all on one engine has p = 2**-15.
    process, url = router(engine_pair, tmp_path, STICKY_POLICY)
    try:
        async with EngineClient(url) as client:
            engines_per_key = {
                key: {await served_by(client, routing_key=key) for _ in range(3)}
                for key in (f"session-{i}" for i in range(16))
            }
    finally:
        process.stop()
    assert all(len(engines) == 1 for engines in engines_per_key.values()), engines_per_key
    assert set().union(*engines_per_key.values()) == set(ENGINE_NAMES)


def test_router_that_cannot_reach_a_worker_fails_with_its_log(engine_pair: list[str], tmp_path: Path) -> None:
    unreachable = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ProcessStartError, match=r"(?s)did not register workers \['http://127.0.0.1:\d+'\].*---"):
        start_router([engine_pair[0], unreachable], port=free_port(), log_path=tmp_path / "router.log", timeout_s=3)
