"""Start and stop a real embedded engine process on a free loopback port (the production command line)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from miles_runner.procs.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 90


@dataclass
class EngineProcess:
    process: subprocess.Popen
    url: str
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; SIGKILL only if it does not exit. Returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_engine(model_dir: Path, log_path: Path, *extra_args: str) -> EngineProcess:
    port = free_port()
    cmd = [
        sys.executable, "-m", "miles_runner.embedded_engine",
        "--model-path", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *extra_args,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = log_path.open("w")
    process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    engine = EngineProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"engine exited with {process.returncode}:\n{engine.log_tail()}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=1.0).status_code == 200:
                return engine
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    engine.stop()
    raise RuntimeError(f"engine not healthy after {STARTUP_TIMEOUT_S}s:\n{engine.log_tail()}")
