"""scripts/gpu_check_megatron.sh, checked without a GPU: the plans it would run compile (--plan-only), it reads the
figures a run records (--summarize on a metrics.jsonl of the loop's own step records), and without a GPU it says
so and exits 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from miles_runner.loops.single_adapter import step_record

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check_megatron.sh"


def run_script(*args: str, timeout_s: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env}
    )


def test_plan_only_compiles_the_raw_bridge_and_twins_plans_it_runs(tmp_path: Path) -> None:
    done = run_script("--plan-only", WORK_DIR=str(tmp_path), MILES_RUN=str(Path(sys.executable).with_name("miles-run")))
    assert done.returncode == 0, done.stdout + done.stderr
    modes = (("raw", "raw"), ("bridge", "bridge"), ("twin", "bridge"), ("glm", "bridge"), ("glm-fp8", "bridge"))
    for mode, lora_mode in modes:
        (plan_file,) = (tmp_path / mode).rglob("plan.yaml")
        plan = yaml.safe_load(plan_file.read_text())
        assert (plan["trainer"]["backend"], plan["trainer"]["lora_mode"]) == ("megatron", lora_mode)
        assert [e["kind"] for e in plan["engines"]] == ["sglang"] and not plan["cluster"]["cpu_only"]
        assert plan["batch"]["num_steps"] == 3
    twin = yaml.safe_load(next((tmp_path / "twin").rglob("plan.yaml")).read_text())
    assert twin["capabilities"]["offload_rollout"] and twin["capabilities"]["offload_train"]
    assert twin["trainer"]["host"] is None and twin["router"] and twin["session"]  # the driver holds the trainer
    fp8 = yaml.safe_load(next((tmp_path / "glm-fp8").rglob("plan.yaml")).read_text())
    assert "--quantization" in fp8["engines"][0]["launch"]["argv"]  # glm52's FP8 rollout, on SGLang only


def write_metrics(folder: Path, records: list[dict]) -> None:
    run = folder / "2026-01-01" / "00-00-00"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def loop_record(step: int, abs_diff: float | None) -> dict:
    """A step record as the single-adapter loop writes it (its keys are what the script reads)."""
    samples = [SimpleNamespace(reward=1.0), SimpleNamespace(reward=0.0)]
    record = step_record(step, samples, {}, {"rollout_logprob_abs_diff": abs_diff, "loss": 0.1}, 1.0, 0)
    return {**record, "verify/logprob_gap": 0.01}


def test_summary_prints_reward_and_mismatch_per_step(tmp_path: Path) -> None:
    write_metrics(tmp_path, [loop_record(step, 0.02) for step in range(3)])
    done = run_script("--summarize", str(tmp_path), PYTHON=sys.executable, STEPS="3")
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["step", "reward/mean", "train/logprob_abs_diff", "verify/logprob_gap"]
    assert [row.split() for row in rows] == [[str(s), "0.5000", "0.0200", "0.0100"] for s in range(3)]


def test_summary_fails_on_a_missing_figure_or_step(tmp_path: Path) -> None:
    write_metrics(tmp_path, [loop_record(0, 0.02), loop_record(1, None)])
    done = run_script("--summarize", str(tmp_path), PYTHON=sys.executable, STEPS="3")
    assert done.returncode == 1
    assert "2 step records, expected 3" in done.stderr and "train/logprob_abs_diff missing" in done.stderr


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path: Path) -> None:
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a GPU")
    done = run_script("--skip-install", WORK_DIR=str(tmp_path))
    assert done.returncode == 2 and "not a GPU machine" in done.stderr


def test_script_passes_shellcheck() -> None:
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed")
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout
