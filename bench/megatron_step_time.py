"""Time per training step of the Megatron trainer (lora_mode=raw, thd and bshd) against the FSDP trainer, on the
`tiny_lora_agentic` recipe's work: its plan (tiny-moe, attention LoRA r8, micro-batches of 32) and a batch of its
shape, 16 prompts x 8 samples of `count_retry` episodes.

The samples are synthetic but shaped as the recipe's rollouts are: the task's own prompts rendered by the model's
chat template, a one-number reply, and for a wrong reply the "Wrong." turn and a second reply (the feedback tokens
masked out of the loss), rewards as `hit_within_turns` gives them. Every trainer gets the same samples; each
`train()` call is one step (one optimizer step on the whole batch). Two-process figures (TP=2, EP=2) run as a gloo
world of two local processes, as the trainer's ranks do on CPU.

    python -m bench.megatron_step_time [--steps 10] [--two-rank-steps 5] [--no-two-rank]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import write_result

RECIPE = "+recipe=tiny_lora_agentic"
ONE_PROCESS = {
    "fsdp": [],
    "megatron raw thd": ["trainer=megatron", "lora_mode=raw", "trainer.parallel.qkv_format=thd"],
    "megatron raw bshd": ["trainer=megatron", "lora_mode=raw", "trainer.parallel.qkv_format=bshd"],
}
# TP=2 and TP=2 x EP=2 keep one data-parallel rank: the experts split over the two TP ranks (expert DP 1).
TWO_PROCESS = {
    f"megatron raw {fmt} {name}": ["trainer=megatron", "lora_mode=raw", f"trainer.parallel.qkv_format={fmt}", *layout]
    for fmt in ("thd", "bshd")
    for name, layout in (
        ("TP=2", ["trainer.parallel.tp=2"]),
        ("TP=2 EP=2", ["trainer.parallel.tp=2", "trainer.parallel.ep=2"]),
    )
}
WARMUP_STEPS = 1  # the first step pays one-off costs (allocator, lazy imports, megatron buffers)


def plan_for(overrides: list[str], ranks: int = 1) -> Any:
    from miles_runner.config.compose import compose
    from miles_runner.plan.compile import compile_plan

    return compile_plan(compose([RECIPE, f"topology.actor_num_gpus_per_node={ranks}", *overrides]))


def recipe_samples(plan: Any) -> list[Any]:
    """One step's batch of the recipe's shape: rollout_batch_size prompts x n_samples_per_prompt episodes, grouped
    by prompt (as the trainer receives them)."""
    from transformers import AutoTokenizer

    from miles_runner.plugins.tasks import TASKS

    tokenizer = AutoTokenizer.from_pretrained(plan.model_path)
    task = TASKS.get(plan.rollout.task)(seed=0)
    rng = random.Random(0)
    samples = []
    for index in range(plan.batch.rollout_batch_size):
        prompt = task.prompt(index)
        for _ in range(plan.batch.n_samples_per_prompt):
            samples.append(episode(tokenizer, task, prompt, rng))
    return samples


def episode(tokenizer: Any, task: Any, prompt: Any, rng: random.Random) -> Any:
    """A count_retry episode played by a policy that answers uniformly at random (the recipe's start)."""
    from miles_runner.session.samples import Sample, SampleStatus

    messages = list(prompt.messages)
    rendered = [render(tokenizer, messages, generation_prompt=True)]
    masks: list[int] = []
    replies: list[str] = []
    reward = 0.0
    while True:
        reply = task.random_reply(prompt, rng)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        masks.append(1)  # the reply's own tokens (and its end-of-turn) are trained
        rendered.append(render(tokenizer, messages, generation_prompt=False))
        if reply == prompt.label:
            reward = 1.0 if len(replies) == 1 else 0.8
        feedback = task.feedback(prompt, replies)
        if feedback is None:
            break
        messages.append({"role": "user", "content": feedback})
        masks.append(0)  # the environment's turn and the next generation prompt are context, not trained
        rendered.append(render(tokenizer, messages, generation_prompt=True))
    tokens, loss_mask = pieces_to_tokens(tokenizer, rendered, masks)
    prompt_length = len(tokenizer.encode(rendered[0], add_special_tokens=False))
    response = len(tokens) - prompt_length
    return Sample(tokens, response, loss_mask, [-1.0] * response, None, SampleStatus.COMPLETED, reward=reward)


def render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def pieces_to_tokens(tokenizer: Any, rendered: list[str], masks: list[int]) -> tuple[list[int], list[int]]:
    """The tokens of the whole transcript (each render extends the last) and the loss mask of its response part."""
    tokens = tokenizer.encode(rendered[0], add_special_tokens=False)
    loss_mask: list[int] = []
    for before, after, mask in zip(rendered[:-1], rendered[1:], masks, strict=True):
        if not after.startswith(before):
            raise ValueError("the chat template re-renders earlier turns: transcript pieces do not extend")
        piece = tokenizer.encode(after[len(before) :], add_special_tokens=False)
        tokens += piece
        loss_mask += [mask] * len(piece)
    return tokens, loss_mask


def timed_step(trainer: Any, samples: list[Any], into: dict[str, list[float]]) -> None:
    """One train() call, its wall and process-CPU seconds (every thread of this process) appended to ``into``."""
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train(samples)
    into["wall"].append(time.perf_counter() - wall)
    into["cpu"].append(time.process_time() - cpu)


def time_steps(trainers: dict[str, Any], samples: list[Any], steps: int) -> dict[str, dict[str, list[float]]]:
    """Each trainer's timed steps after the warm-up ones, the trainers taking turns step by step, so that load
    from elsewhere on a shared machine falls on every row alike."""
    times = {name: {"wall": [], "cpu": []} for name in trainers}
    for step in range(WARMUP_STEPS + steps):
        for name, trainer in trainers.items():
            timed_step(trainer, samples, times[name] if step >= WARMUP_STEPS else {"wall": [], "cpu": []})
    return times


def one_process(configs: dict[str, list[str]], samples: list[Any], steps: int) -> dict[str, dict[str, list[float]]]:
    """The one-process trainers side by side in this process (the Megatron ones share one TP=1 parallel state)."""
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.ranks import build_trainer

    trainers = {name: build_trainer(plan_for(overrides)) for name, overrides in configs.items()}
    try:
        return time_steps(trainers, samples, steps)
    finally:
        parallel.destroy()


def two_process(overrides: list[str], steps: int, timeout_s: float = 900) -> dict[str, list[float]]:
    """Rank 0's step times of a 2-process gloo world running `--rank-worker` (the ranks step in lockstep)."""
    from miles_testkit.ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="megatron-step-") as work:
        out = Path(work) / "rank0.json"
        argv = [
            sys.executable,
            "-m",
            "bench.megatron_step_time",
            "--rank-worker",
            json.dumps(overrides),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ]
        run_ranks(argv, 2, timeout_s, f"two-process step timing {overrides}")
        return json.loads(out.read_text())


def rank_worker(overrides: list[str], steps: int, out: Path) -> None:
    import torch.distributed as dist

    from miles_runner.trainer.ranks import build_trainer

    dist.init_process_group("gloo")
    plan = plan_for(overrides, ranks=2)
    trainer = build_trainer(plan)
    times = time_steps({"rank": trainer}, recipe_samples(plan), steps)["rank"]
    if dist.get_rank() == 0:
        out.write_text(json.dumps(times))
    dist.destroy_process_group()


def summary_row(name: str, times: dict[str, list[float]], baseline: dict[str, list[float]]) -> str:
    wall, cpu, base = times["wall"], times["cpu"], baseline["wall"]
    return (
        f"| {name} | {statistics.median(wall):.3f} | {min(wall):.3f} - {max(wall):.3f} | "
        f"{statistics.median(cpu):.3f} | {len(wall)} | {statistics.median(wall) / statistics.median(base):.2f}x | "
        f"{min(wall) / min(base):.2f}x |"
    )


def batch_shape(samples: list[Any]) -> dict[str, Any]:
    lengths = [len(s.tokens) for s in samples]
    trained = sum(sum(s.loss_mask) for s in samples)
    return {
        "samples": len(samples),
        "tokens": sum(lengths),
        "trained_tokens": trained,
        "min_len": min(lengths),
        "median_len": statistics.median(lengths),
        "max_len": max(lengths),
        "two_turn_share": sum(1 for s in samples if 0 in s.loss_mask) / len(samples),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trainer (after one warm-up step)")
    parser.add_argument("--two-rank-steps", type=int, default=5, help="timed steps of each two-process layout")
    parser.add_argument("--no-two-rank", action="store_true", help="skip the TP=2 / EP=2 two-process figures")
    parser.add_argument("--rank-worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        rank_worker(json.loads(args.rank_worker), args.steps, args.out)
        return
    from miles_runner.models.format_pretrain import ensure_format_pretrained

    ensure_format_pretrained("tiny-moe")
    plan = plan_for([])
    samples = recipe_samples(plan)
    shape = batch_shape(samples)
    figures = one_process(ONE_PROCESS, samples, args.steps)
    if not args.no_two_rank:
        for name, overrides in TWO_PROCESS.items():
            figures[name] = two_process(overrides, args.two_rank_steps)
            print(f"{name}: median {statistics.median(figures[name]['wall']):.3f} s", flush=True)
    report(figures, shape, args.steps, args.two_rank_steps)


Figures = dict[str, dict[str, list[float]]]  # trainer -> {"wall": [...], "cpu": [...]} seconds per step


def report(figures: Figures, shape: dict[str, Any], steps: int, two_rank_steps: int) -> None:
    load = os.getloadavg()[0]
    summary = [
        f"`python -m bench.megatron_step_time` (`tiny_lora_agentic` plan: tiny-moe, attention LoRA r8, micro-batches "
        f"of 32, one optimizer step per batch), {shape['samples']} synthetic count_retry episodes of the recipe's "
        f"shape ({shape['tokens']} tokens, {shape['trained_tokens']} trained; lengths {shape['min_len']}-"
        f"{shape['max_len']}, median {shape['median_len']}; {shape['two_turn_share']:.0%} two-turn), the same for "
        f"every trainer; {steps} timed steps (two-process: {two_rank_steps}) after {WARMUP_STEPS} warm-up, "
        f"1-min load {load:.1f} at the end (the machine is shared: compare rows of one run). Two-process rows: a "
        "gloo world of 2 local processes (1 thread each), rank 0's step time; their layouts keep one data-parallel "
        "rank. The one-process trainers take turns step by step (other load falls on each alike); the two-process "
        "rows run after them. CPU s: the process's CPU time over all its threads (rank 0's alone in the two-process "
        "rows); under load torch's spinning threads inflate it too.",
        "",
        "| trainer | median s/step | min - max | median CPU s/step | steps | median vs fsdp | min vs fsdp |",
        "|---|---|---|---|---|---|---|",
        *(summary_row(name, times, figures["fsdp"]) for name, times in figures.items()),
        "",
        "thd packs a micro-batch's samples first-fit into rows of at most packing.PACKED_ROW_TOKENS tokens and, with "
        "no varlen attention kernel in megatron's local layer spec, attends through an explicit block-diagonal mask "
        "per row: attention costs rows x W^2 for rows of width W, where the padded rows (bshd) cost rows x L^2.",
    ]
    medians = {name: {kind: statistics.median(v) for kind, v in times.items()} for name, times in figures.items()}
    write_result(
        "megatron_step_time",
        {"batch": shape, "steps": steps, "two_rank_steps": two_rank_steps, "seconds": figures, "median_s": medians},
        summary,
    )
    print("\n".join(summary))


if __name__ == "__main__":
    main()
