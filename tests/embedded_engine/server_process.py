"""Start and stop a real embedded engine process on a free loopback port (the production command line), through
the testkit's launcher: supervised, health-checked, and forked by the worker's warm start server where there is one
(a cold start costs seconds of CPU more, nearly all imports)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.procs.process import ManagedProcess
from miles_testkit.launch import embedded_engine_argv
from miles_testkit.launch import start_engine as launch_engine

STARTUP_TIMEOUT_S = 90


@dataclass
class EngineProcess:
    process: ManagedProcess
    url: str

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (the whole process group), then wait; SIGKILL only if it does not exit. Returns the exit code."""
        return self.process.stop(timeout)


def start_engine(model_dir: Path, log_path: Path, *extra_args: str) -> EngineProcess:
    port = free_port()
    argv = embedded_engine_argv(model_dir, port, *extra_args)
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = launch_engine(argv, port=port, log_path=log_path, env=env, timeout_s=STARTUP_TIMEOUT_S)
    return EngineProcess(process, f"http://{LOOPBACK}:{port}")
