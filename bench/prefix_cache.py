"""The embedded engine's prefix cache on agent-shaped traffic: concurrent multi-turn sessions, each turn re-sending
its whole conversation plus a new user message (as the session server's turns do), with the cache on and with
`--disable-radix-cache`.

    .venv/bin/python -m bench.prefix_cache [--sessions 32] [--turns 16] [--repeats 5]

Writes bench/results/prefix_cache.json and the "prefix_cache" section of bench/REPORT.md: per setting, the wall
time of the whole workload and the engine process's CPU seconds (medians over interleaved repeats), and the share of
prompt tokens served from the cache (`meta_info.cached_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.engine_throughput import start_server
from bench.report import write_result
from miles_runner.models.tiny_model import ensure_tiny_model

USER_TOKENS = 24  # a new user message per turn
NEW_TOKENS = 8  # the model's answer per turn
SETTINGS = {"cache": (), "no cache": ("--disable-radix-cache",)}


def user_message(session: int, turn: int) -> list[int]:
    return [5 + (session * 31 + turn * 7 + i) % 290 for i in range(USER_TOKENS)]


async def run_sessions(url: str, sessions: int, turns: int) -> tuple[int, int]:
    """Every session's turns, sessions concurrent; returns (prompt tokens, of them served from the cache)."""
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:

        async def session(index: int) -> tuple[int, int]:
            history: list[int] = []
            prompt = cached = 0
            for turn in range(turns):
                history += user_message(index, turn)
                reply = (await http.post("/generate", json={"input_ids": history, "sampling_params": params})).json()
                prompt += reply["meta_info"]["prompt_tokens"]
                cached += reply["meta_info"]["cached_tokens"]
                history += reply["output_ids"]
            return prompt, cached

        totals = await asyncio.gather(*(session(i) for i in range(sessions)))
    return sum(t[0] for t in totals), sum(t[1] for t in totals)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a running process (Linux: /proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_once(setting: str, sessions: int, turns: int) -> dict:
    with tempfile.TemporaryFile("w+") as log:
        process, url = start_server(ensure_tiny_model("tiny-moe"), log, *SETTINGS[setting])
        try:
            asyncio.run(run_sessions(url, 2, 2))  # warm-up
            httpx.post(f"{url}/flush_cache", timeout=60)
            cpu, started = cpu_seconds(process.pid), time.perf_counter()
            prompt, cached = asyncio.run(run_sessions(url, sessions, turns))
            wall, cpu = time.perf_counter() - started, cpu_seconds(process.pid) - cpu
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    return {"wall_s": wall, "engine_cpu_s": cpu, "prompt_tokens": prompt, "cached_tokens": cached}


def measure(sessions: int, turns: int, repeats: int) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(repeats):  # interleaved: the machine's drift falls on both settings alike
        for name in SETTINGS:
            runs[name].append(measure_once(name, sessions, turns))
    medians = {
        name: {key: statistics.median(r[key] for r in rs) for key in ("wall_s", "engine_cpu_s")}
        for name, rs in runs.items()
    }
    first = runs["cache"][0]
    return {
        "model": "tiny-moe (Qwen3-MoE, 2 layers, hidden 64, 8 experts, top-2)",
        "sessions": sessions,
        "turns": turns,
        "user_tokens_per_turn": USER_TOKENS,
        "new_tokens_per_turn": NEW_TOKENS,
        "repeats": repeats,
        "runs": runs,
        "medians": medians,
        "cached_share": round(first["cached_tokens"] / first["prompt_tokens"], 3),
        "cpu_ratio": round(medians["cache"]["engine_cpu_s"] / medians["no cache"]["engine_cpu_s"], 3),
        "wall_ratio": round(medians["cache"]["wall_s"] / medians["no cache"]["wall_s"], 3),
    }


def write_report(results: dict) -> None:
    m = results["medians"]
    lines = [
        f"`python -m bench.prefix_cache` ({results['model']}): {results['sessions']} concurrent sessions x "
        f"{results['turns']} turns, each turn the whole conversation plus {results['user_tokens_per_turn']} new tokens,"
        f" {results['new_tokens_per_turn']} greedy tokens out; medians of {results['repeats']} interleaved repeats.",
        "",
        "| setting | wall s | engine CPU s |",
        "|---|---|---|",
        *[f"| {name} | {v['wall_s']:.2f} | {v['engine_cpu_s']:.2f} |" for name, v in m.items()],
        "",
        f"Prompt tokens served from the cache: {100 * results['cached_share']:.1f}%. With the cache: engine CPU "
        f"x{results['cpu_ratio']}, wall x{results['wall_ratio']} of `--disable-radix-cache`.",
    ]
    write_result("prefix_cache", results, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = measure(args.sessions, args.turns, args.repeats)
    write_report(results)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
