"""The CPU twins of the GPU recipes, run whole through `miles-run`: what offload releases and restores per step,
what it costs a step, and the logprob gap of every push after the engines resume; for the multi-LoRA twin (no
offload: disaggregated), its iteration time, every slot push's probe gap and each adapter's reward gain.

Each twin runs `--steps` steps as its recipe says (offload both ways), then again with both offloads off, twice in
turns (a slow spell of a shared machine hits both alike). From the runs' offload events
(RUN_DIR/offload_events.jsonl) and step records, medians over the steps after the first of each run (which also
pays the start-up's warm-up):

- released: the bytes the engines report freed by `release_memory_occupation` (all of them together);
- restored: the growth of the engines' resident memory from right after the release to right after the KV cache
  is back (weights reloaded, adapter pushed, one probe served);
- trainer moved: what the trainer's offload moved out (on a CPU host, target cpu moves nothing);
- offload s: the seconds the offload calls take in a step; step s with and without offload;
- gap: `verify/logprob_gap`, the largest |trainer - engine| logprob of the push probe, scored right after each
  push, which lands after every resume.

Writes bench/results/twins.json and its section of bench/REPORT.md. Needs the Megatron-Bridge environment
(`make bridge-env`).

    .venv/bin/python -m bench.twins [--steps 6]
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
from miles_runner.core.paths import source_checkout

MB = 2**20
TWINS = ("tiny_qwen3_30b_a3b_r3_session", "tiny_glm52_lora_agentic")
MULTI_LORA_TWIN = "tiny_multi_lora_math"
MULTI_LORA_ADAPTERS = ("count", "retry", "letters")
# Both offloads off, and what only offload takes: the disk target and the engines' CPU weight backup.
NO_OFFLOAD = (
    "topology.offload_train=false",
    "topology.offload_rollout=false",
    "trainer.offload_target=cpu",
    "adapters.base_cpu_backup=false",
)
ROUNDS = 2


def run_twin(recipe: str, steps: int, *overrides: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"twin-{recipe}-"))
    argv = [sys.executable, "-m", "miles_runner.cli.main", f"+recipe={recipe}", f"algorithm.num_steps={steps}"]
    argv += [f"run.output_root={root}", "logger=none", *overrides]
    subprocess.run(argv, check=True, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True)
    [plan] = root.rglob("plan.yaml")
    return plan.parent


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def engine_rss(event: dict[str, Any]) -> int:
    return sum(engine["rss_bytes"] for engine in event["engines"])


def offload_figures(run_dir: Path) -> dict[str, float]:
    records = jsonl(run_dir / "metrics.jsonl")[1:]
    events = jsonl(run_dir / "offload_events.jsonl")
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for event in events:
        by_step.setdefault(event["iteration"], {})[event["event"]] = event
    steps = [by_step[r["step"]] for r in records]
    released = [sum(sum(e["freed_bytes"].values()) for e in s["offload_rollout"]["engines"]) / MB for s in steps]
    restored = [(engine_rss(s["onload_kv"]) - engine_rss(s["offload_rollout"])) / MB for s in steps]
    return {
        "released_mb": statistics.median(released),
        "restored_mb": statistics.median(restored),
        "trainer_moved_mb": statistics.median(r["offload/trainer_moved_mb"] for r in records),
        "offload_s": statistics.median(r["offload/seconds"] for r in records),
        "step_s": statistics.median(r["step/seconds"] for r in records),
        "gap_median": statistics.median(r["verify/logprob_gap"] for r in records),
        "gap_max": max(r["verify/logprob_gap"] for r in records),
    }


def multi_lora_figures(run_dir: Path) -> dict[str, float]:
    """Iteration seconds (train + push, medians), every push's probe gap, and each adapter's reward gain (its last
    quarter's mean minus its first quarter's)."""
    records = jsonl(run_dir / "metrics.jsonl")[1:]
    pushed = [e for e in jsonl(run_dir / "multi_lora_events.jsonl") if e["event"] == "pushed"]
    gaps = [gap for event in pushed for gap in event.get("probe_gaps", {}).values()]
    figures = {
        "train_s": statistics.median(r["train/seconds"] for r in records if "train/seconds" in r),
        "sync_s": statistics.median(r["sync/seconds"] for r in records if "sync/seconds" in r),
        "pushes": float(len(gaps)),
        "gap_median": statistics.median(gaps),
        "gap_max": max(gaps),
    }
    for name in MULTI_LORA_ADAPTERS:
        rewards = [r[f"{name}/reward/mean"] for r in records if f"{name}/reward/mean" in r]
        quarter = max(1, len(rewards) // 4)
        figures[f"{name}_gain"] = statistics.mean(rewards[-quarter:]) - statistics.mean(rewards[:quarter])
    return figures


def resident_step_s(run_dir: Path) -> float:
    return statistics.median(r["step/seconds"] for r in jsonl(run_dir / "metrics.jsonl")[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    checkout = source_checkout()
    if checkout and "MILES_BRIDGE_PYTHON" not in os.environ:
        os.environ["MILES_BRIDGE_PYTHON"] = str(checkout / ".venv-bridge" / "bin" / "python")
    figures: dict[str, dict[str, float]] = {}
    for recipe in TWINS:
        # With and without offload in turns (ABAB), so that a slow spell of a shared machine hits both alike.
        on: list[dict[str, float]] = []
        off: list[float] = []
        for _ in range(ROUNDS):
            on.append(offload_figures(run_twin(recipe, args.steps)))
            off.append(resident_step_s(run_twin(recipe, args.steps, *NO_OFFLOAD)))
        figures[recipe] = {key: statistics.median(f[key] for f in on) for key in on[0]}
        figures[recipe]["resident_step_s"] = statistics.median(off)
    lines = [
        f"Each twin whole through `miles-run`, {ROUNDS} x {args.steps} steps each way (the first of each run left "
        "out), medians per step; "
        "released and restored are the engines' resident memory (all engines together).",
        "",
        "| twin | engines released MB | restored MB | trainer moved MB | offload s | step s | step s without "
        "offload | logprob gap after resume (median, max) |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {f['released_mb']:.2f} | {f['restored_mb']:.2f} | {f['trainer_moved_mb']:.1f} | "
            f"{f['offload_s']:.3f} | {f['step_s']:.2f} | {f['resident_step_s']:.2f} | "
            f"{f['gap_median']:.1e}, {f['gap_max']:.1e} |"
            for name, f in figures.items()
        ),
    ]
    multi = multi_lora_figures(run_twin(MULTI_LORA_TWIN, 40))
    figures[MULTI_LORA_TWIN] = multi
    lines += [
        "",
        f"{MULTI_LORA_TWIN} (three adapters in Megatron multi-LoRA slots on Bridge's model, disaggregated, no "
        "offload), one run of its 40 steps: medians per iteration, every slot push's probe gap, each adapter's "
        "reward gain (last quarter's mean minus the first's).",
        "",
        "| train s | sync s | pushes | probe gap (median, max) | gain count | gain retry | gain letters |",
        "|---|---|---|---|---|---|---|",
        f"| {multi['train_s']:.2f} | {multi['sync_s']:.2f} | {multi['pushes']:.0f} | {multi['gap_median']:.1e}, "
        f"{multi['gap_max']:.1e} | {multi['count_gain']:+.3f} | {multi['retry_gain']:+.3f} | "
        f"{multi['letters_gain']:+.3f} |",
    ]
    write_result("twins", figures, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
