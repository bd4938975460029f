"""What push verification sees and costs on the tiny recipes (weight_sync.verify, weight_sync.max_logprob_gap).

Runs through `miles-run`, each in a fresh run folder:
- tiny_lora_agentic, healthy: the logprob gap of each push's first batch (verify/logprob_gap), the seconds the
  trainer takes to score it (verify/seconds) and the seconds every engine takes to report its version after a
  push (sync/verify_seconds), against the push itself (sync/seconds) and a train step (train/seconds);
- tiny_lora_agentic under the fault switch MILES_FAULT_FREEZE_ROLLOUT_ADAPTER with verification off: the gap
  the check would have seen at each step (train/logprob_abs_diff: every batch is the first of its push);
- the same fault with verification on: where the run stops.
Writes bench/results/push_verification.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.push_verification [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.report import write_result
from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER
from miles_runner.procs.ports import free_port


def miles_run(root: Path, recipe: str, steps: int, *overrides: str, fault: bool = False) -> tuple[int, str, list]:
    """(exit code, stderr, metrics records) of one run of `recipe`."""
    env = {**os.environ, "WANDB_MODE": "disabled", FREEZE_ROLLOUT_ADAPTER: "1" if fault else "0"}
    args = [
        f"+recipe={recipe}",
        f"run.output_root={root}",
        "logger=none",
        f"algorithm.num_steps={steps}",
        f"engine.base_port={free_port()}",
        f"session.port={free_port()}",
        f"adapters.api_port={free_port()}",
        *overrides,
    ]
    done = subprocess.run(
        [sys.executable, "-m", "miles_runner.cli.main", *args], env=env, capture_output=True, text=True
    )
    files = list(root.rglob("metrics.jsonl"))
    rows = [json.loads(line) for line in files[0].read_text().splitlines()] if files else []
    return done.returncode, done.stderr, rows


def spread(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "max": max(values), "min": min(values)}


def column(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def healthy(root: Path, steps: int) -> dict[str, Any]:
    code, err, rows = miles_run(root, "tiny_lora_agentic", steps)
    assert code == 0, err[-3000:]
    keys = ("verify/logprob_gap", "verify/seconds", "sync/verify_seconds", "sync/seconds", "train/seconds")
    return {key: spread(column(rows, key)) for key in keys}


def frozen(root: Path, steps: int) -> dict[str, Any]:
    code, err, rows = miles_run(root / "off", "tiny_lora_agentic", steps, "weight_sync.verify=false", fault=True)
    assert code == 0, err[-3000:]
    gaps = column(rows, "train/logprob_abs_diff")
    code, err, rows = miles_run(root / "on", "tiny_lora_agentic", steps, fault=True)
    stop = next((line.strip() for line in err.splitlines() if "SyncVerificationError" in line), "")
    return {"gap_by_step": gaps, "verified_exit_code": code, "verified_steps_trained": len(rows), "stop": stop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    steps = parser.parse_args().steps
    root = Path(tempfile.mkdtemp(prefix="push-verification-"))
    figures = {"steps": steps, "healthy": healthy(root / "healthy", steps), "frozen": frozen(root / "frozen", steps)}
    h, f = figures["healthy"], figures["frozen"]
    ms = {
        key: 1000 * h[key]["median"]
        for key in ("verify/seconds", "sync/verify_seconds", "sync/seconds", "train/seconds")
    }
    lines = [
        f"`tiny_lora_agentic`, {steps} steps; default tolerance 0.01 on the embedded engine.",
        "",
        "| run | logprob gap: mean abs(trainer - rollout) per trained token |",
        "|---|---|",
        f"| tiny_lora_agentic, healthy | median {h['verify/logprob_gap']['median']:.2e}, max "
        f"{h['verify/logprob_gap']['max']:.2e} over {h['verify/logprob_gap']['n']} pushes |",
        f"| tiny_lora_agentic, frozen adapter (verify off), steps 0-{len(f['gap_by_step']) - 1} | "
        + ", ".join(f"{g:.3f}" for g in f["gap_by_step"])
        + " |",
        "",
        f"Frozen adapter with verification on: exit code {f['verified_exit_code']} after "
        f"{f['verified_steps_trained']} trained step(s): `{f['stop'][:160]}...`",
        "",
        f"Cost per push (medians): the engines' version check {ms['sync/verify_seconds']:.1f} ms, scoring the first "
        f"batch {ms['verify/seconds']:.0f} ms; against the push itself {ms['sync/seconds']:.0f} ms and a train step "
        f"{ms['train/seconds']:.0f} ms.",
    ]
    write_result("push_verification", figures, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
