"""How these tests launch embedded engines."""

from __future__ import annotations

import sys
from pathlib import Path

from miles_runner.procs.ports import LOOPBACK

EMBEDDED = "miles_runner.embedded_engine"
ENGINE_START_TIMEOUT_S = 180.0
TEST_ENV = {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def plain_engine_argv(model_dir: Path, port: int, *extra: str) -> list[str]:
    """An embedded engine without LoRA: what the router tests put behind the router."""
    return [
        sys.executable,
        "-m",
        EMBEDDED,
        "--model-path",
        str(model_dir),
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        *extra,
    ]
