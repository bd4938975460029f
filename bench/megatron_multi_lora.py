"""Megatron multi-LoRA parity: how far each slot's adapter, trained beside another slot, is from the same adapter
trained alone by the one-adapter Megatron trainer, and how far other layouts and Bridge's model are from one
process. The computation is the tests' (tests/trainer/megatron/multi_lora_case.py): two slots with their own rank,
alpha, targets and learning rate, each from a non-zero start, two train calls (gradients kept), one SGD step, R3
replayed; figures are the largest |difference| over every exported adapter tensor after the step, and the relative
difference of the step's gradient norm.

- alone: each slot against the one-adapter trainer on the same adapter and samples (one process);
- dp2, tp2-ep2-sp: two gloo ranks against one process;
- bridge: the slots on Megatron-Bridge's model against the slots on megatron-core's (needs `make bridge-env`).

Writes bench/results/megatron_multi_lora.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.megatron_multi_lora
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.report import write_result
from miles_runner.core.paths import source_checkout
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.trainer.megatron import parallel
from tests.trainer.megatron.multi_lora_case import ADAPTERS, multi_case, single_reference, start_state
from tests.trainer.ranks_helper import run_ranks

LAYOUTS = {"dp2": {}, "tp2-ep2-sp": {"tp": 2, "ep": 2, "sp": True}}
BRIDGE_CASE = """
import sys, torch
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.bridge import BridgeMultiLoRATrainer
from tests.trainer.megatron.multi_lora_case import multi_case
out = multi_case(sys.argv[1], parallel.Layout(), torch.load(sys.argv[2]), trainer_class=BridgeMultiLoRATrainer)
torch.save(out, sys.argv[3])
"""


def largest_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def compared(reference: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """Largest adapter difference and relative grad-norm difference over both slots."""
    norms = [abs(other["metrics"][1][s]["grad_norm"] / reference["metrics"][1][s]["grad_norm"] - 1) for s in ADAPTERS]
    diffs = [largest_diff(reference["after"][s], other["after"][s]) for s in ADAPTERS]
    return {"max_abs_diff": max(diffs), "grad_norm_rel_diff": max(norms)}


def bridge_case(model: str, starts: Path, out: Path) -> dict[str, Any] | None:
    checkout = source_checkout()
    python = checkout / ".venv-bridge" / "bin" / "python" if checkout else None
    if python is None or not python.is_file():
        return None
    subprocess.run([str(python), "-c", BRIDGE_CASE, model, str(starts), str(out)], check=True, cwd=checkout)
    return torch.load(out)


def main() -> None:
    model = str(ensure_tiny_model("tiny-moe"))
    work = Path(tempfile.mkdtemp(prefix="multi-lora-parity-"))
    starts = {slot: start_state(model, slot) for slot in ADAPTERS}
    torch.save(starts, work / "starts.pt")
    one = multi_case(model, parallel.Layout(), starts)
    alone = {slot: single_reference(model, slot, starts[slot]) for slot in ADAPTERS}
    moved = max(largest_diff(one["after"][s], starts[s]) for s in ADAPTERS)
    figures: dict[str, dict[str, float]] = {
        "alone": {"max_abs_diff": max(largest_diff(one["after"][s], alone[s]) for s in ADAPTERS)}
    }
    for name, layout in LAYOUTS.items():
        run_ranks(
            "tests.trainer.megatron.multi_lora_worker",
            2,
            [model, work / "starts.pt", json.dumps(layout), work / f"{name}.pt"],
            timeout=600,
        )
        figures[name] = compared(one, torch.load(work / f"{name}.pt"))
    bridge = bridge_case(model, work / "starts.pt", work / "bridge.pt")
    if bridge is not None:
        figures["bridge"] = compared(one, bridge)
    lines = [
        f"Two slots (r4 attention, r8 MLP + experts) on tiny-moe, one SGD step after two train calls, R3 replayed; "
        f"the step moved the adapters by up to {moved:.3f}. Largest |difference| over every exported tensor.",
        "",
        "| compared | max abs diff | grad-norm rel diff |",
        "|---|---|---|",
        *(
            f"| {name} | {f['max_abs_diff']:.1e} | {f['grad_norm_rel_diff']:.1e} |"
            if "grad_norm_rel_diff" in f
            else f"| {name} (slot vs one-adapter trainer) | {f['max_abs_diff']:.1e} | - |"
            for name, f in figures.items()
        ),
    ]
    write_result("megatron_multi_lora", {"moved": moved, **figures}, lines)
    print("\n".join(lines))
    sys.exit(0)


if __name__ == "__main__":
    main()
