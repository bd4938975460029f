"""The push probe in a multi-LoRA run (weight_sync/probe.py): every adapter push is probed on the engine against the
trainer's slot, and under the fault switch that re-pushes each adapter's first weights the run stops with exit 3
at that adapter's first push after it stepped, before the trainer trains again."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER
from miles_runner.procs.ports import free_port
from tests.drivers import runner_command

from .runs import TOKEN, events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_frozen_adapter_stops_a_multi_lora_run_at_its_first_push_after_a_step(tmp_path: Path):
    env = {**os.environ, "WANDB_MODE": "offline", "MILES_MULTI_LORA_API_TOKEN": TOKEN, FREEZE_ROLLOUT_ADAPTER: "1"}
    args = [
        "+recipe=tiny_multi_lora",
        f"engine.base_port={free_port()}",
        f"adapters.api_port={free_port()}",
        f"run.output_root={tmp_path}",
        "logger=none",
    ]
    done = subprocess.run(
        runner_command("miles_runner.cli.main", *args), env=env, capture_output=True, text=True, timeout=880
    )
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    [error] = [line for line in done.stderr.splitlines() if "SyncVerificationError: iteration" in line]
    print(error)
    found = re.search(r"iteration (\d+), adapter (\w+): weight version \d+: the probe of adapter '(\w+)'", error)
    assert found and "weight_sync.max_logprob_gap=0.01: engine http://127.0.0.1:" in error, error
    breach, name = int(found[1]), found[2]
    [run_dir] = {p.parent for p in tmp_path.rglob("plan.yaml")}
    trained = events(run_dir, "trained")
    # Its first step was in the iteration just before: the breach is its first push after a step.
    assert [e["iteration"] for e in trained if name in e["step_names"]] == [breach - 1]
    assert max(e["iteration"] for e in trained) == breach - 1  # nothing trained after the breach
