"""Two runs started at the same instant on the same ports: one runs, the other fails cleanly naming the port, and
neither touches the other's servers (a health answer alone would let the loser use the winner's servers)."""

from __future__ import annotations

import dataclasses
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from miles_runner.executors.local import Deployment, LocalExecutor
from miles_runner.plan.model import Plan
from miles_runner.procs.launch import PortBusyError
from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess, ProcessStartError, running_processes
from tests.compiled import compile_overrides

pytestmark = [pytest.mark.reliability, pytest.mark.integration]

ROUNDS = 8
# A request line of uvicorn's access log, which the engines and the session server write: `"GET /health HTTP/1.1"`.
REQUEST_LINE = re.compile(r'"([A-Z]+ \S+) HTTP/[\d.]+"')
HEALTH_PROBE = "GET /health"


def tiny_plan(engine_port: int, session_port: int) -> Plan:
    """The default tiny CPU recipe's servers: an engine and the session server, whose access log (off at its default
    log level) records every request it serves."""
    plan = compile_overrides(
        ["+recipe=tiny_lora_agentic", f"engine.base_port={engine_port}", f"session.port={session_port}"]
    )
    assert isinstance(plan, Plan) and plan.session is not None, plan
    session = plan.session.launch
    logged = dataclasses.replace(session, argv=[*session.argv, "--log-level", "info"])
    return dataclasses.replace(plan, session=dataclasses.replace(plan.session, launch=logged))


def plans_sharing(shared: str) -> list[Plan]:
    """Two runs' plans on the same session port, and on the same engine port too unless only the session's is shared
    (then the race is at the second server started, with each run's engine already up)."""
    engine_port, session_port = free_port(), free_port()
    engine_ports = [engine_port, engine_port] if shared == "every port" else [engine_port, free_port()]
    return [tiny_plan(port, session_port) for port in engine_ports]


def addresses(plan: Plan) -> list[str]:
    """host:port of each server of the plan."""
    assert plan.session is not None
    return [f"{launch.host}:{launch.port}" for launch in (plan.engines[0].launch, plan.session.launch)]


def requests_served(run_dir: Path) -> list[str]:
    """Every request line in the logs of a run's servers."""
    return [match for log in (run_dir / "logs").glob("*.log") for match in REQUEST_LINE.findall(log.read_text())]


def start_together(executors: list[LocalExecutor]) -> list[Deployment | BaseException]:
    barrier = threading.Barrier(len(executors))

    def start(executor: LocalExecutor) -> Deployment:
        barrier.wait()
        return executor.start()

    with ThreadPoolExecutor(len(executors)) as pool:
        futures = [pool.submit(start, executor) for executor in executors]
    return [future.exception() or future.result() for future in futures]


def summary(outcome: Deployment | BaseException) -> str:
    return "started" if isinstance(outcome, Deployment) else f"{type(outcome).__name__}: {str(outcome)[:300]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared", ["every port", "the session port"])
def test_two_runs_on_the_same_ports_one_runs_and_the_other_fails_cleanly_every_time(
    tmp_path: Path, shared: str
) -> None:
    LocalExecutor(plans_sharing(shared)[0], tmp_path / "prepare").prepare_model()  # built once, not by both runs
    for round_ in range(ROUNDS):
        # Ports chosen afresh each round, right before the start: chosen once, a port free at the first round may be
        # taken by another test's server (the suite runs in parallel workers) by a later one.
        plans = plans_sharing(shared)
        shared_ports = set(addresses(plans[0])) & set(addresses(plans[1]))
        before = set(running_processes())
        runs = [tmp_path / f"round{round_}-{side}" for side in "ab"]
        executors = [LocalExecutor(plan, run) for plan, run in zip(plans, runs, strict=True)]
        outcomes = start_together(executors)
        try:
            won = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, Deployment)]
            assert len(won) == 1, f"round {round_}: {[summary(outcome) for outcome in outcomes]}"
            winner, loser = won[0], 1 - won[0]
            deployment, failure = outcomes[winner], outcomes[loser]
            assert isinstance(deployment, Deployment)
            assert isinstance(failure, ProcessStartError | PortBusyError), f"round {round_}: {failure!r}"
            assert any(port in str(failure) for port in shared_ports), str(failure)
            left: set[ManagedProcess] = set(running_processes()) - before
            assert left == set(deployment.processes)  # nothing of the loser's is left running
            assert set(requests_served(runs[winner])) == {HEALTH_PROBE}
            assert set(requests_served(runs[loser])) <= {HEALTH_PROBE}
        finally:
            for executor in executors:
                executor.stop()
