"""The proof: the default recipe (`make run`) learns on CPU, and does not when rollouts miss the adapter.

Both runs are the default recipe through the real engine, session server and OpenAI-client agent. The second
sets the named fault switch that keeps the engines on the initial (identity) adapter, so its rollouts never
use what was trained: if the first run's gain came from anywhere else, the second would show it too.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER
from miles_runner.procs.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WINDOW = 10
MARGIN = 0.06


def run_default_recipe(root: Path, *, fault: bool) -> list[float]:
    env = {**os.environ, "WANDB_MODE": "disabled", FREEZE_ROLLOUT_ADAPTER: "1" if fault else "0"}
    args = ["+recipe=tiny_lora_agentic", f"run.output_root={root}", "logger=none",
            f"engine.base_port={free_port()}", f"session.port={free_port()}"]
    done = subprocess.run([sys.executable, "-m", "miles_runner.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (f"FAULT SWITCH {FREEZE_ROLLOUT_ADAPTER}=1" in done.stderr) == fault  # a fault run says so
    [metrics] = root.rglob("metrics.jsonl")
    return [json.loads(line)["reward/mean"] for line in metrics.read_text().splitlines()]


def gain(rewards: list[float]) -> float:
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW


def test_default_recipe_learns_only_when_rollouts_use_the_trained_adapter(tmp_path):
    learned = run_default_recipe(tmp_path / "adapter", fault=False)
    frozen = run_default_recipe(tmp_path / "frozen", fault=True)
    print(f"gain with the adapter {gain(learned):+.3f}, with rollouts frozen on the initial adapter "
          f"{gain(frozen):+.3f}")
    assert gain(learned) >= MARGIN, learned
    assert gain(frozen) < MARGIN, frozen
    assert gain(learned) - gain(frozen) >= MARGIN
