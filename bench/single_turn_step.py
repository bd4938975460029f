"""Time per step of `miles-run` single-turn (`session=off`), with its breakdown and the start-up's, on the work of
bench/peers (BENCHMARKS.md): tiny-moe (2 layers), 8 prompts x 8 samples, at most 8 new tokens, one optimizer step per
batch, LoRA r8 on q/k/v/o (the tiny_lora_agentic recipe's adapter, optimizer and learning rate), the single-turn `count`
task.

Each run is one `miles-run` process. Per step the loop records `step/seconds` (record to record, so it holds the
rollout, train, sync, verify and bookkeeping) beside `rollout/seconds`, `train/seconds`, `sync/seconds` and
`verify/seconds` in metrics.jsonl; the start-up milestones are RUN_DIR/startup.json (loops/single_adapter.py).
Medians skip the first step (it pays one-off costs: first forwards, allocator, lazy imports).

    python -m bench.single_turn_step [--runs 1] [--steps 20] [override ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import write_result

REPO = Path(__file__).resolve().parents[1]
WORK = [
    "+recipe=tiny_lora_agentic",
    "session=off",
    "rollout.task=count",
    "rollout.reward=exact_match",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=8",
    "rollout.max_response_len=8",
    "logger=none",
]
STEP_PARTS = ("step/seconds", "rollout/seconds", "train/seconds", "sync/seconds", "verify/seconds")
# (name, from milestone, to milestone); "process_start"/"process_end" are the bench's own clock.
STARTUP_PARTS = (
    ("imports, compose, plan", "process_start", "loop_started"),
    ("engines started and healthy", "loop_started", "engines_ready"),
    ("trainer: the wait for it once the engines are up", "engines_ready", "trainer_ready"),
    ("rollout context, sync, probe", "trainer_ready", "rollout_ready"),
    ("first push", "rollout_ready", "first_push_done"),
    ("first step", "first_push_done", "first_step_done"),
    ("shutdown", "loop_ended", "process_end"),
)
# Not a share of the sum: the trainer is built while the engines start (CPU, one rank; loops/single_adapter.py).
OVERLAPPED_PARTS = (
    ("trainer build, from the loop's start (overlaps the engines' start)", "loop_started", "trainer_built"),
)


def run_once(steps: int, overrides: list[str], run_dir: Path, repo: Path = REPO) -> dict[str, Any]:
    """One miles-run process of the checkout `repo` (another one's code: before/after figures): its wall time,
    per-step records and start-up milestones."""
    env = {
        **os.environ,
        "MILES_CACHE_DIR": os.environ.get("MILES_CACHE_DIR", str(REPO / ".cache")),
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "PYTHONPATH": str(repo),
    }
    command = [
        sys.executable,
        "-m",
        "miles_runner.cli.main",
        *WORK,
        f"algorithm.num_steps={steps}",
        *overrides,
        f"hydra.run.dir={run_dir}",
    ]
    started = time.time()
    done = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    ended = time.time()
    if done.returncode:
        raise RuntimeError(f"miles-run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    stamps = {**json.loads((run_dir / "startup.json").read_text()), "process_start": started, "process_end": ended}
    return {"wall_s": ended - started, "records": records, "stamps": stamps}


def step_figures(records: list[dict[str, Any]]) -> dict[str, float]:
    steady = records[1:] or records
    return {key: statistics.median(r.get(key) or 0.0 for r in steady) for key in STEP_PARTS}


def startup_figures(stamps: dict[str, float]) -> dict[str, float]:
    return {
        name: stamps[end] - stamps[begin]
        for name, begin, end in STARTUP_PARTS + OVERLAPPED_PARTS
        if begin in stamps and end in stamps
    }


def measure(runs: int, steps: int, overrides: list[str], repo: Path = REPO) -> dict[str, Any]:
    per_run = []
    with tempfile.TemporaryDirectory(prefix="single-turn-step-") as tmp:
        for index in range(runs):
            outcome = run_once(steps, overrides, Path(tmp) / f"run{index}", repo)
            per_run.append(
                {
                    "wall_s": outcome["wall_s"],
                    "step": step_figures(outcome["records"]),
                    "startup": startup_figures(outcome["stamps"]),
                    "final_reward": outcome["records"][-1]["reward/mean"],
                    "rewards": [r["reward/mean"] for r in outcome["records"]],
                }
            )
    median = statistics.median
    return {
        "work": [*WORK, f"algorithm.num_steps={steps}", *overrides],
        "runs": per_run,
        "step_median_s": {k: median(r["step"][k] for r in per_run) for k in STEP_PARTS},
        "wall_median_s": median(r["wall_s"] for r in per_run),
        "startup_median_s": {
            k: median(r["startup"].get(k, 0.0) for r in per_run) for k, *_ in STARTUP_PARTS + OVERLAPPED_PARTS
        },
    }


def summary(figures: dict[str, Any]) -> list[str]:
    step, runs = figures["step_median_s"], figures["runs"]
    lines = [
        f"`miles-run {' '.join(figures['work'])}`, {len(runs)} run(s); medians over steps 2.. of each run, "
        "then over runs.",
        "",
        "| per step | seconds |",
        "|---|---|",
    ]
    lines += [f"| {key} | {value:.3f} |" for key, value in step.items()]
    lines += ["", f"Whole process: {figures['wall_median_s']:.1f} s. Start-up:", "", "| phase | seconds |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in figures["startup_median_s"].items()]
    lines += ["", "Final-step reward per run: " + ", ".join(f"{r['final_reward']:.3f}" for r in runs)]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-write", action="store_true", help="print the figures, leave bench/results alone")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to run (default: this one)")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides for every run")
    args = parser.parse_args()
    figures = measure(args.runs, args.steps, args.overrides, args.repo)
    print("\n".join(summary(figures)))
    if not args.no_write:
        write_result("single_turn_step", figures, summary(figures))


if __name__ == "__main__":
    main()
