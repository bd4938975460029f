"""Starting a recorded multi-LoRA run in a child process, and reading what it leaves in its run folder."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_runner.procs.ports import free_port
from tests.drivers import runner_command

TOKEN = "e2e-token"


def plan_run(output_root: Path, *overrides: str) -> Path:
    """Compile +recipe=tiny_multi_lora with free ports and record it; returns the run folder."""
    from miles_runner.cli.main import single_run

    args = [
        "+recipe=tiny_multi_lora",
        f"engine.base_port={free_port()}",
        f"adapters.api_port={free_port()}",
        f"run.output_root={output_root}",
        "logger=wandb_offline",
        *overrides,
    ]
    assert single_run(args, plan_only=True, argv=args) == 0
    [plan] = output_root.rglob("plan.yaml")
    return plan.parent


def start_driver(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "MILES_MULTI_LORA_API_TOKEN": TOKEN}
    return subprocess.Popen(
        runner_command("miles_runner.loops.run", str(run_dir), *extra),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    return jsonl(run_dir / "metrics.jsonl")


def events(run_dir: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in jsonl(run_dir / "multi_lora_events.jsonl") if kind is None or e["event"] == kind]


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.2)


def adapter_rewards(records: list[dict[str, Any]], name: str) -> list[float]:
    return [r[f"{name}/reward/mean"] for r in records if f"{name}/reward/mean" in r]
