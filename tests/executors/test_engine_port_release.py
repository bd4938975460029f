"""An engine that died is restarted on its own port (executor.engine_restarts) once the dead engine's processes let
go of it; a port that another process took meanwhile is named at once, and nothing is started on it."""

import os
import socket
import time

import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.local import PORT_RELEASE_TIMEOUT_S, EngineLostError, LocalExecutor
from miles_runner.plan.compile import compile_plan

from .test_engine_restart import kill_engine

pytestmark = [pytest.mark.timeout(180), pytest.mark.integration]


def test_a_port_another_process_took_from_a_dead_engine_is_named_and_nothing_is_restarted_on_it(tmp_path):
    plan = compile_plan(compose(["+recipe=tiny_lora_agentic", "session=off", "executor.engine_restarts=1"]))
    executor = LocalExecutor(plan, tmp_path, startup_timeout_s=120)
    with executor as deployment, socket.socket() as thief:
        dead, port = executor.engines[0], deployment.plan.engines[0].launch.port
        kill_engine(executor, 0)
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", port))  # another run's server, on a port it found free
        thief.listen()
        asked = time.monotonic()
        with pytest.raises(EngineLostError, match=f"its port {port} is still held by pid {os.getpid()} "):
            executor.restart_dead_engines()
        assert time.monotonic() - asked < PORT_RELEASE_TIMEOUT_S, "it waited for a holder that is not the engine's"
        assert executor.engines[0] is dead, "an engine was started on a port another process holds"
