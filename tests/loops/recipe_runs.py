"""A recipe run through `miles-run` in a subprocess, and the learning measure of its rewards: shared by the
learning proofs of each trainer backend (test_learning.py: FSDP, test_learning_megatron.py: Megatron)."""

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER
from tests.drivers import runner_command
from tests.run_files import files_named

WINDOW = 10
MARGIN = 0.06
# The learning proofs (FSDP, Megatron, the router recipe) run the recipes' first 35 of their 40 steps at lr 0.01, and
# ask for a gain (the last 10 steps' mean reward minus the first 10's) of MARGIN: well inside what a learning run
# gains by then, and well above a frozen adapter's noise. Fewer steps left too little room: a run whose reward dips
# for a few steps (a spike in gradient norm) and recovers must still pass. bench/grpo_learning.py measures the curve.
LEARNING_STEPS = 35
LEARNING_RUN = f"algorithm.num_steps={LEARNING_STEPS}"


def recipe_command(root: Path, *overrides: str, recipe: str = "tiny_lora_agentic") -> list[str]:
    """miles-run's command line for the recipe's run under `root` (its servers choose their ports at start)."""
    return runner_command(
        "miles_runner.cli.main",
        f"+recipe={recipe}",
        f"run.output_root={root}",
        "logger=none",
        *overrides,
    )


def run_env(*, fault: bool) -> dict[str, str]:
    """The run's environment: no tracking; with `fault`, the switch that freezes the rollouts' adapter."""
    return {**os.environ, "WANDB_MODE": "disabled", FREEZE_ROLLOUT_ADAPTER: "1" if fault else "0"}


def miles_run(root: Path, *overrides: str, fault: bool, recipe: str = "tiny_lora_agentic", timeout_s: float = 880):
    """The recipe's run; with `fault`, under the switch that freezes the rollouts' adapter."""
    done = subprocess.run(
        recipe_command(root, *overrides, recipe=recipe),
        env=run_env(fault=fault),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert (f"FAULT SWITCH {FREEZE_ROLLOUT_ADAPTER}=1" in done.stderr) == fault  # a fault run says so
    return done


def recorded_run(root: Path, base: Sequence[str], *overrides: str) -> Path:
    """The folder of a run recorded under `root` (`miles-run --plan`: plan.yaml, nothing started) from the
    overrides `base` + `overrides`; a test then runs it in-process."""
    from miles_runner.cli.main import single_run

    args = [*base, f"run.output_root={root}", *overrides]
    assert single_run(args, plan_only=True, argv=args) == 0
    [plan] = root.rglob("plan.yaml")
    return plan.parent


def records(root: Path) -> list[dict]:
    """The metrics records of the one run under `root` (none yet: [])."""
    found = files_named(root, "metrics.jsonl")  # the run may be writing a checkpoint
    return [json.loads(line) for line in found[0].read_text().splitlines()] if found else []


def run_default_recipe(
    root: Path, *overrides: str, fault: bool, recipe: str = "tiny_lora_agentic", timeout_s: float = 880
) -> list[float]:
    """The recipe's rewards step by step (`overrides` on top of it, e.g. another trainer backend)."""
    # The control run trains on under a frozen adapter only with its push verification off.
    done = miles_run(
        root,
        *overrides,
        *(["weight_sync.verify=false"] if fault else []),
        fault=fault,
        recipe=recipe,
        timeout_s=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [record["reward/mean"] for record in records(root)]


def gain(rewards: list[float]) -> float:
    return sum(rewards[-WINDOW:]) / WINDOW - sum(rewards[:WINDOW]) / WINDOW
