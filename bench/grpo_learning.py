"""Does LoRA GRPO learn on 2 CPU cores in a few minutes? In-process rollouts (HF generate with the peft
model), reward, GRPO step, repeat; no servers. Each case reports the mean reward of the first and last five
steps; the adapter-off control samples from the base model (the adapter trains but never generates).

    python -m bench.grpo_learning [--only NAME ...] [--steps N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.report import write_result
from miles_runner.core.adapters import AdapterSpec
from miles_runner.loops.inprocess import LocalRunConfig, LocalRunResult, run_local_grpo
from miles_runner.rollout.inprocess import SamplingSettings

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass(frozen=True)
class Case:
    name: str
    task: str
    reward: str
    pretrained: bool  # format pre-training of the tiny model (miles_runner.models.format_pretrain)
    adapter_in_rollouts: bool = True
    lr: float = 0.005
    prompts: int = 16
    samples: int = 8
    max_new_tokens: int = 4
    max_turns: int = 1


CASES = (
    Case("count", "count", "exact_match", pretrained=True),
    Case("count_adapter_off", "count", "exact_match", pretrained=True, adapter_in_rollouts=False),
    Case("guess_number", "guess_number", "guess_number", pretrained=True, max_turns=3),
    Case(
        "guess_number_adapter_off",
        "guess_number",
        "guess_number",
        pretrained=True,
        adapter_in_rollouts=False,
        max_turns=3,
    ),
    Case("arith", "arith", "exact_match", pretrained=True),
    Case("count_no_pretraining", "count", "exact_match", pretrained=False),
)


def model_path(pretrained: bool) -> Path:
    from miles_runner.models.format_pretrain import ensure_format_pretrained
    from miles_runner.models.tiny_model import ensure_tiny_model

    return ensure_format_pretrained("tiny-moe") if pretrained else ensure_tiny_model("tiny-moe")


def run_case(case: Case, steps: int) -> LocalRunResult:
    adapter = AdapterSpec(
        "miles_lora", "miles_lora", 8, 16.0, 0.0, ATTENTION, case.task, case.reward, case.lr, case.prompts, case.samples
    )
    sampling = SamplingSettings(case.max_new_tokens, max_turns=case.max_turns)
    config = LocalRunConfig(
        str(model_path(case.pretrained)), adapter, sampling, steps, adapter_in_rollouts=case.adapter_in_rollouts
    )
    return run_local_grpo(config)


def time_format_pretraining() -> float:
    """Seconds to pre-train a fresh copy (the cached model is what the cases use)."""
    from miles_runner.models.format_pretrain import pretrain_format
    from miles_runner.models.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as folder:
        build_tiny_model(folder)
        started = time.perf_counter()
        pretrain_format(folder)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    pretrain_s = time_format_pretraining()
    figures: dict = {
        "steps": args.steps,
        "lora": {"rank": 8, "alpha": 16, "targets": ATTENTION},
        "format_pretrain_build_s": round(pretrain_s, 1),
        "cases": {},
    }
    lines = [
        f"In-process LoRA GRPO on tiny-moe (HF generate with the peft model, temperature 1, at most 4 new "
        f"tokens per turn), {args.steps} steps, attention LoRA r8/a16 (q,k,v,o), Adam, one optimizer step "
        "per rollout; reward = mean of the first / last 5 steps. Format pre-training "
        "(`models.format_pretrain`) fits the init-0.1 model on random *well-formed* episodes of every "
        "task, so it answers with a number at about chance (count: 1/6; guess_number with uniform guesses: "
        "~0.27); the LoRA then has to learn which number. The adapter-off rows train the same adapter but "
        "sample from the base model.",
        "",
        "| case | task | model | rollouts | lr | prompts x samples | first 5 | last 5 | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        result = run_case(case, args.steps)
        first, last = result.window_mean(True), result.window_mean(False)
        figures["cases"][case.name] = {
            **asdict(case),
            "first5": first,
            "last5": last,
            "wall_s": result.wall_s,
            "rewards": result.rewards,
        }
        lines.append(
            f"| {case.name} | {case.task} | {'format-pretrained' if case.pretrained else 'init 0.1'} | "
            f"{'adapter' if case.adapter_in_rollouts else 'base (adapter off)'} | {case.lr} | "
            f"{case.prompts} x {case.samples} | {first:.3f} | {last:.3f} | {result.wall_s:.0f} |"
        )
        print(lines[-1], flush=True)
    lines += ["", f"Format pre-training of a fresh tiny model: {pretrain_s:.0f} s (cached after the first build)."]
    write_result("grpo_learning", figures, lines)


if __name__ == "__main__":
    main()
