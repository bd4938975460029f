"""BENCHMARKS.md, bench/results/peers.json and the reward plot from the runs of `bench.peers.run`.

Time per step: each run's median over its steps after the first (warm-up), then the median and min–max of those
run medians. Ratios (miles / TRL) are taken within a run, where both sides ran back to back, then summarised
the same way. Final reward: the last step's batch reward, and the mean of the last three steps, over the runs.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import statistics
import subprocess
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.peers.records import SideRun
from bench.peers.work import ROWS, PeerWork
from miles_runner.core.paths import cache_dir

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
RESULTS_JSON = RESULTS_DIR / "peers.json"
PLOT = RESULTS_DIR / "peers_reward.png"
MAIN_PACKAGES = ("miles-runner", "torch", "transformers", "peft")
PARTS = ("rollout_s", "train_s", "sync_s", "other_s")
SINGLE_TURN_TARGET = 1.5  # the goal: miles' single-turn median time per step <= 1.5x TRL's

Runs = list[dict[str, dict[str, SideRun]]]  # per run: row -> side ("trl" | "miles") -> what it measured


def machine(load_before: tuple[float, float, float]) -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_before": [round(x, 2) for x in load_before],
    }


def main_versions() -> dict[str, str]:
    versions = {name: version(name) for name in MAIN_PACKAGES}
    here = Path(__file__).parent
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here)
    changed = subprocess.run(["git", "diff", "--quiet", "HEAD"], capture_output=True, cwd=here).returncode == 1
    versions["commit"] = (commit.stdout.strip() or "unknown") + (" with uncommitted changes" if changed else "")
    return versions


def portable(path: str) -> str:
    """`path` with the user's cache folder written as `<cache>` (miles_runner/core/paths.py), so that the report and
    the saved results, which the repository keeps, name no folder of the machine that ran them."""
    cache = str(cache_dir())
    return "<cache>" + path[len(cache) :] if path == cache or path.startswith(cache + os.sep) else path


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float], digits: int = 3) -> str:
    mid, low, high = spread(values)
    return f"{mid:.{digits}f} ({low:.{digits}f}–{high:.{digits}f})" if len(values) > 1 else f"{mid:.{digits}f}"


def row_figures(runs: Runs, row: str) -> dict[str, Any]:
    """The row's figures over the runs: per side, time per step, breakdown, process time, rewards; the ratios."""
    figures: dict[str, Any] = {}
    for side in ("trl", "miles"):
        sides = [run[row][side] for run in runs]
        figures[side] = {
            "step_s": [s.median() for s in sides],
            "process_s": [s.process_s for s in sides],
            "final_reward": [s.rewards()[-1] for s in sides],
            "last3_reward": [statistics.fmean(s.rewards()[-3:]) for s in sides],
            "rewards": [s.rewards() for s in sides],
        }
        if all(step.other_s is not None for s in sides for step in s.steady()):  # a breakdown measured
            for part in PARTS:
                figures[side][part] = [s.median(part) for s in sides]
    figures["ratio_step"] = [m / t for m, t in zip(figures["miles"]["step_s"], figures["trl"]["step_s"], strict=True)]
    figures["ratio_process"] = [
        m / t for m, t in zip(figures["miles"]["process_s"], figures["trl"]["process_s"], strict=True)
    ]
    return figures


def time_table(figures: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| row | side | time per step, s | rollout | train | sync | other | whole process, s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, f in figures.items():
        for side, name in (("trl", "TRL `GRPOTrainer` + peft"), ("miles", "`miles-run`")):
            parts = " | ".join(fmt(f[side][part]) if part in f[side] else "" for part in PARTS)
            lines.append(
                f"| {ROWS[row].title} | {name} | {fmt(f[side]['step_s'])} | {parts} | {fmt(f[side]['process_s'], 1)} |"
            )
    return lines


def ratio_table(figures: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| row | miles / TRL, time per step | miles / TRL, whole process | per run (step) |", "|---|---|---|---|"]
    for row, f in figures.items():
        per_run = ", ".join(f"{r:.2f}×" for r in f["ratio_step"])
        lines.append(f"| {ROWS[row].title} | {fmt(f['ratio_step'], 2)}× | {fmt(f['ratio_process'], 2)}× | {per_run} |")
    return lines


def reward_table(figures: dict[str, dict[str, Any]], steps: int) -> list[str]:
    lines = [f"| row | side | reward at step {steps} | mean of the last 3 steps |", "|---|---|---|---|"]
    for row, f in figures.items():
        for side, name in (("trl", "TRL"), ("miles", "miles-run")):
            lines.append(
                f"| {ROWS[row].title} | {name} | {fmt(f[side]['final_reward'])} | {fmt(f[side]['last3_reward'])} |"
            )
    return lines


def targets(figures: dict[str, dict[str, Any]]) -> list[str]:
    if "single_turn" not in figures:
        return []
    f = figures["single_turn"]
    ratio = statistics.median(f["ratio_step"])
    ours, theirs = (statistics.fmean(f[s]["last3_reward"]) for s in ("miles", "trl"))
    met = {True: "met", False: "not met"}
    return [
        f"- single-turn time per step ≤ {SINGLE_TURN_TARGET}× TRL's: **{met[ratio <= SINGLE_TURN_TARGET]}** "
        f"({ratio:.2f}×)",
        f"- reward after the same steps ≥ TRL's (mean of the last 3 steps, over the runs): "
        f"**{met[ours >= theirs]}** ({ours:.3f} vs {theirs:.3f})",
    ]


def plot(figures: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(figures), figsize=(5.5 * len(figures), 3.8), squeeze=False)
    for ax, (row, f) in zip(axes[0], figures.items(), strict=True):
        for side, name, color in (("trl", "TRL GRPOTrainer + peft", "tab:orange"), ("miles", "miles-run", "tab:blue")):
            curves = f[side]["rewards"]
            for curve in curves:
                ax.plot(range(1, len(curve) + 1), curve, color=color, alpha=0.2, linewidth=0.8)
            mean = [statistics.fmean(step) for step in zip(*curves, strict=True)]
            ax.plot(range(1, len(mean) + 1), mean, color=color, linewidth=2, label=f"{name} (mean of {len(curves)})")
        ax.set(title=ROWS[row].title.replace("`", ""), xlabel="step", ylabel="batch reward (mean of 64 samples)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def work_lines(context: dict[str, Any]) -> list[str]:
    work, peers = context["work"], context["peers"]
    peer = next(iter(peers.values()))
    lines = [
        f"- Model: `{peer['model_path']}` (the recipe's `tiny:tiny-moe:format`: a 2-layer Qwen3-MoE, hidden 64, "
        "8 experts top-2, format-pretrained), built once by miles-run's own executor code and loaded by both.",
        f"- Each step: {work['prompts']} prompts × {work['samples']} samples, at most {work['max_new_tokens']} "
        f"new tokens per turn, temperature {work['temperature']}, top-p 1; one optimizer step (Adam, lr "
        f"{work['lr']} constant, betas {tuple(peer['adam_betas'])}, grad clip {peer['clip_grad']}); GRPO with "
        f"std-normalised group advantages, per-sample loss, clip {peer['eps_clip']}/{peer['eps_clip_high']}, no "
        f"KL, no MoE aux loss; LoRA r{work['lora_rank']}/α{work['lora_alpha']} on {', '.join(work['targets'])}.",
        f"- {work['steps']} steps, seed {work['seed']} (miles `run.seed`, TRL `seed`); the prompts of step k are "
        "the task's prompts 8k..8k+7 on both sides (miles' data cursor; TRL `shuffle_dataset=False`).",
    ]
    threads = context.get("trl_threads", 1)
    lines.append(
        "- Threads: miles-run runs each of its processes (engine, trainer) on one torch intra-op thread; the "
        f"TRL process gets {threads or 'torch’s default number of'} (`--trl-threads`; 0: torch's default, "
        "one per core, far slower when other processes share the cores)."
    )
    for row, peer in peers.items():
        lines.append(
            f"- {ROWS[row].title}: task `{peer['task']}`, reward `{peer['reward']}` (the project's "
            f"registered function, called by both), up to {peer['max_turns']} turn(s)."
        )
    return lines


def trl_settings_line(context: dict[str, Any]) -> str:
    from bench.peers.trl_side import grpo_settings  # stdlib and the project only: importable without TRL

    peer = PeerWork.from_json(json.dumps(next(iter(context["peers"].values()))))
    settings = ", ".join(f"{k}={v!r}" for k, v in grpo_settings(peer).items())
    return (
        f"TRL's `GRPOConfig` (`bench/peers/trl_side.py`, `grpo_settings`): {settings}; peft `LoraConfig(r="
        f"{peer.lora_rank}, lora_alpha={peer.lora_alpha}, lora_dropout=0.0, target_modules={peer.targets})`."
    )


def command_lines(runs: Runs) -> list[str]:
    lines = [
        "```",
        "make bench-peers   # 3 runs of 10 steps, both rows: this file, bench/results/peers.json, the plot",
        "# a quick check that leaves them alone (about a minute a row):",
        'make bench-peers PEERS_ARGS="--runs 1 --steps 3 --out /tmp/peers.md --results /tmp/peers"',
        ".venv/bin/python -m bench.peers.report   # this file again from bench/results/peers.json",
        "```",
        "",
        "What each side ran (first run; ports and folders differ per run):",
        "",
    ]
    for row, sides in runs[0].items():
        for side in ("trl", "miles"):
            lines += [f"- {ROWS[row].title}, {side}:", "", "  ```", f"  {' '.join(sides[side].command)}", "  ```"]
    return lines


def write_report(runs: Runs, context: dict[str, Any], out: Path, results_dir: Path = RESULTS_DIR) -> None:
    """`context`: machine, started (a timestamp), work and peers (as dicts), versions (main, peers)."""
    peers = {row: {**peer, "model_path": portable(peer["model_path"])} for row, peer in context["peers"].items()}
    context = {**context, "peers": peers}
    results_dir.mkdir(parents=True, exist_ok=True)
    raw = {
        "context": context,
        "runs": [{row: {side: r.to_dict() for side, r in s.items()} for row, s in run.items()} for run in runs],
    }
    (results_dir / RESULTS_JSON.name).write_text(json.dumps(raw, indent=1))  # kept even if the report fails
    figures = {row: row_figures(runs, row) for row in runs[0]}
    plot_path = results_dir / PLOT.name
    plot(figures, plot_path)
    out.write_text("\n".join(report_lines(runs, context, figures, os.path.relpath(plot_path, out.parent))))


def report_lines(runs: Runs, context: dict[str, Any], figures: dict[str, Any], plot_link: str) -> list[str]:
    m, versions, steps = context["machine"], context["versions"], context["work"]["steps"]
    stamp = dt.datetime.fromtimestamp(context["started"]).astimezone().isoformat(timespec="seconds")
    return [
        "# Benchmarks: `miles-run` against TRL's `GRPOTrainer` + peft",
        "",
        f"_Written by `make bench-peers` (bench/peers/) on {stamp}; regenerate rather than edit._",
        "",
        "## Machine",
        "",
        f"- {m['cpu']}, {m['cores']} cores; {m['platform']}; load average (1/5/15 min) {m['load_before']} "
        f"before, {m.get('load_after')} after. Both sides share the machine with whatever else runs: compare the "
        "ratios, which are measured within one run, where the two sides ran back to back.",
        f"- main venv (miles-run): {', '.join(f'{k} {v}' for k, v in versions['main'].items())}",
        f"- peers venv (.venv-peers, TRL): {', '.join(f'{k} {v}' for k, v in versions['peers'].items())}",
        "",
        "## The work",
        "",
        *work_lines(context),
        "",
        "## Time per step",
        "",
        f"{len(runs)} runs of {steps} steps per side and row. A step's time is from the end of the previous step to "
        "the end of this one (miles: its `step k/N` lines; TRL: a TrainerCallback's `on_step_end`); the first step "
        "(warm-up) is left out. Each figure: the median over the runs of each run's median, with the min–max over "
        "the runs. The miles breakdown is read from the run's metrics.jsonl: `rollout/seconds`, `train/seconds`, "
        "sync = `sync/seconds` + the post-push probe's `verify/seconds`; other = the rest of the step (metrics, "
        "prompt batching). TRL's: rollout = the seconds in the trainer's `_generate` (tokenize, generate, decode; "
        "the multi-turn loop), train = the rest of the step body (rewards, advantages, forward, backward, optimizer "
        "step), no sync (it trains the model it generates with), other = logging and data loading between steps. "
        "Whole process: the subprocess from start to exit (imports, model load, server "
        "start and stop for miles).",
        "",
        *time_table(figures),
        "",
        "Ratios, miles / TRL, each measured within one run:",
        "",
        *ratio_table(figures),
        "",
        "## Reward",
        "",
        f"Batch reward (the mean over the step's 64 samples, before that step's update), over the {len(runs)} runs. "
        "The samples differ between the sides from the first step (each has its own sampler and RNG streams; the "
        "seed fixes each side's own run), and a few steps move the reward little (count's chance level is 1/6): "
        "`--steps 40` (the recipe's length) shows the learning curves.",
        "",
        *reward_table(figures, steps),
        "",
        f"![reward per step]({plot_link})",
        "",
        "## Targets (from this run)",
        "",
        *targets(figures),
        "",
        "## How TRL plays the agentic task",
        "",
        "TRL 1.16's built-in multi-turn support is tool calling (`tools`, `environment_factory`): the model must emit "
        "tool calls its chat template parses, and the answer comes back as a tool message. The recipe's task "
        '(`count_retry`) answers as the user does ("Wrong. Reply with a single number."), which tool calling '
        "cannot express, so the TRL side uses GRPOTrainer's `rollout_func` (experimental in 1.16) with the feedback "
        "loop written in bench/peers/trl_rollout.py on TRL's own generation (`_generate_single_turn`): one token "
        "stream per sample (prompt | reply | feedback | reply), the feedback masked out of the loss (`env_mask`), "
        "the same reward function on every reply. miles-run plays it through its session server (the "
        "`feedback_loop` agent over the OpenAI-style API).",
        "",
        "## Commands",
        "",
        *command_lines(runs),
        "",
        trl_settings_line(context),
        "",
    ]


def main() -> None:
    """Rewrite BENCHMARKS.md from saved results: python -m bench.peers.report [RESULTS_JSON [OUT]]."""
    import sys

    source = Path(sys.argv[1]) if len(sys.argv) > 1 else RESULTS_JSON
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS_DIR.parent.parent / "BENCHMARKS.md"
    raw = json.loads(source.read_text())
    runs = [
        {row: {side: SideRun.from_dict(r) for side, r in sides.items()} for row, sides in run.items()}
        for run in raw["runs"]
    ]
    write_report(runs, raw["context"], out, source.parent)


if __name__ == "__main__":
    main()
