"""The proof: the default recipe (`make run`) learns on CPU, and does not when rollouts miss the adapter.

Both runs are the default recipe through the real engine, session server and OpenAI-client agent. The second
sets the named fault switch that keeps the engines on the initial (identity) adapter, so its rollouts never
use what was trained: if the first run's gain came from anywhere else, the second would show it too. That
control run turns push verification off explicitly (weight_sync.verify=false): with it on, as by default, the
same fault stops the run at the first batch after the first push, before the trainer steps on it.
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


def miles_run(root: Path, *overrides: str, fault: bool, recipe: str = "tiny_lora_agentic"):
    """The recipe's run; with `fault`, under the switch that freezes the rollouts' adapter."""
    env = {**os.environ, "WANDB_MODE": "disabled", FREEZE_ROLLOUT_ADAPTER: "1" if fault else "0"}
    args = [f"+recipe={recipe}", f"run.output_root={root}", "logger=none",
            f"engine.base_port={free_port()}", f"session.port={free_port()}", *overrides]
    done = subprocess.run([sys.executable, "-m", "miles_runner.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=880)
    assert (f"FAULT SWITCH {FREEZE_ROLLOUT_ADAPTER}=1" in done.stderr) == fault  # a fault run says so
    return done


def records(root: Path) -> list[dict]:
    [metrics] = root.rglob("metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def run_default_recipe(root: Path, *, fault: bool, recipe: str = "tiny_lora_agentic") -> list[float]:
    # The control run trains on under a frozen adapter only with its push verification off.
    done = miles_run(root, *(["weight_sync.verify=false"] if fault else []), fault=fault, recipe=recipe)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [record["reward/mean"] for record in records(root)]


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


def test_a_frozen_adapter_stops_the_verified_run_before_the_trainer_steps_on_its_rollouts(tmp_path):
    done = miles_run(tmp_path, "checkpoint.interval=1", fault=True)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    [error] = [line for line in done.stderr.splitlines() if "SyncVerificationError: step 1:" in line]
    assert "weight version 1 (by engine http://127.0.0.1:" in error and "weight_sync.max_logprob_gap=0.01" in error
    assert [r["step"] for r in records(tmp_path)] == [0]  # step 1 was never trained
    [run_dir] = {p.parent for p in tmp_path.rglob("metrics.jsonl")}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    assert not (run_dir / "adapter").exists()
