"""Added latency of the session server per turn, against calling the engine directly.

Starts the embedded engine and a standalone session server (both real processes on loopback), then plays
agents of TURNS turns each, at concurrency 1 and 32, once straight to the engine and once through a
session. Writes bench/results/session_latency.json and its section of bench/REPORT.md (bench.report).

    .venv/bin/python -m bench.session_latency
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np

from bench.report import write_result
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.procs.ports import free_port
from miles_runner.procs.process import ManagedProcess
from miles_runner.sglang_client.client import http_client
from miles_testkit.launch import start_engine

TURNS = 10
MAX_TOKENS = 4
CONCURRENCY = (1, 32)
# Rounds each way per concurrency. At 1 the engine's own latency varies by more than the added p50's target, so the
# added p50 is stable from run to run only over many rounds; at 32 a round holds many turns, but the added p99, a
# tail, still swings widely over a few rounds.
ROUNDS = {1: 120, 32: 12}
# Whole passes over both concurrencies: the table pools them; each pass's figures show the spread.
PASSES = 3


@contextmanager
def engine_and_session_server(session_flags: list[str], engine_flags: list[str] = ()):
    """The embedded engine and one standalone session server in front of it; yields (engine, server) URLs."""
    model_dir = ensure_tiny_model("tiny-moe")
    logs = Path(tempfile.mkdtemp(prefix="session-bench-"))
    engine_port, server_port = free_port(), free_port()
    engine_argv = [sys.executable, "-m", "miles_runner.embedded_engine", "--model-path", str(model_dir)]
    engine_argv += ["--host", "127.0.0.1", "--port", str(engine_port), *engine_flags]
    engine = start_engine(engine_argv, port=engine_port, log_path=logs / "engine.log", timeout_s=300)
    engine_url, server_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{server_port}"
    server_argv = [sys.executable, "-m", "miles_runner.session.server", "--engine-url", engine_url]
    server_argv += ["--model-path", str(model_dir), "--port", str(server_port), *session_flags]
    server = ManagedProcess(
        "session-server", server_argv, log_path=logs / "session.log", health_url=f"{server_url}/health"
    )
    try:
        with server:
            yield engine_url, server_url
    finally:
        engine.stop()


async def play_agent(http: httpx.AsyncClient, chat_url: str, agent: int, latencies: list[float]) -> None:
    messages: list[dict] = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"Agent {agent}: what is {turn} plus 4?"})
        body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        body |= {"logprobs": True, "return_meta_info": True}  # what the session server asks for too
        started = time.perf_counter()
        reply = await http.post(chat_url, json=body)
        latencies.append(time.perf_counter() - started)
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})


async def measure(
    engine_url: str, server_url: str, concurrency: int, through_session: bool
) -> tuple[list[float], float]:
    """One round: `concurrency` agents at once; their per-turn latencies and the round's wall seconds."""
    latencies: list[float] = []
    # The client the agentic rollout's agents chat through (rollout/agentic.py: httpx's API over aiohttp's pool).
    # httpx's own pool delayed a share of session turns at high concurrency before the server even parsed them
    # (timestamps at the client and at the server's ASGI entry, with the server's event loop not lagging).
    async with http_client("", timeout_s=600) as http:
        urls = []
        for _ in range(concurrency):
            if through_session:
                session_id = (await http.post(f"{server_url}/sessions")).json()["session_id"]
                urls.append(f"{server_url}/sessions/{session_id}/v1/chat/completions")
            else:
                urls.append(f"{engine_url}/v1/chat/completions")
        started = time.perf_counter()
        await asyncio.gather(*(play_agent(http, url, i, latencies) for i, url in enumerate(urls)))
        seconds = time.perf_counter() - started
        if through_session:  # as the agentic rollout does once it has the session's samples
            await asyncio.gather(*(http.delete(url.removesuffix("/v1/chat/completions")) for url in urls))
    return latencies, seconds


def summary(latencies: list[float], seconds: float) -> dict[str, float]:
    values = np.asarray(latencies) * 1000
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 2),
        "p99_ms": round(float(np.percentile(values, 99)), 2),
        "turns_per_s": round(len(latencies) / seconds, 1),
    }


Collected = dict[str, tuple[list[float], float]]  # side -> (per-turn latencies, seconds)


async def collect(engine_url: str, server_url: str, concurrency: int) -> Collected:
    """ROUNDS[concurrency] rounds each way, interleaved (direct, session, session, direct, ...) so that drift in the
    machine's load falls on both sides alike."""
    collected: Collected = {"direct": ([], 0.0), "session": ([], 0.0)}
    for round_index in range(ROUNDS[concurrency]):
        order = ("direct", "session") if round_index % 2 == 0 else ("session", "direct")
        for side in order:
            latencies, seconds = await measure(engine_url, server_url, concurrency, side == "session")
            kept, total = collected[side]
            collected[side] = (kept + latencies, total + seconds)
    return collected


def pooled(passes: list[Collected]) -> Collected:
    return {side: ([x for p in passes for x in p[side][0]], sum(p[side][1] for p in passes)) for side in passes[0]}


def compare(collected: Collected) -> dict:
    direct, session = (summary(*collected[side]) for side in ("direct", "session"))
    return {
        "direct": direct,
        "session": session,
        "added_p50_ms": round(session["p50_ms"] - direct["p50_ms"], 2),
        "added_p99_ms": round(session["p99_ms"] - direct["p99_ms"], 2),
        "added_p99_fraction": round((session["p99_ms"] - direct["p99_ms"]) / direct["p99_ms"], 3),
        "throughput_ratio": round(session["turns_per_s"] / direct["turns_per_s"], 3),
    }


async def run() -> dict:
    rounds = {str(concurrency): count for concurrency, count in ROUNDS.items()}
    results = {
        "turns_per_agent": TURNS,
        "max_tokens": MAX_TOKENS,
        "rounds": rounds,
        "passes": PASSES,
        "by_concurrency": {},
    }
    passes: dict[int, list[Collected]] = {concurrency: [] for concurrency in CONCURRENCY}
    with engine_and_session_server(session_flags=[]) as (engine_url, server_url):
        await measure(engine_url, server_url, CONCURRENCY[-1], through_session=True)  # warm-up
        for _ in range(PASSES):
            for concurrency in CONCURRENCY:
                passes[concurrency].append(await collect(engine_url, server_url, concurrency))
    for concurrency, collected in passes.items():
        row = compare(pooled(collected))
        row["per_pass"] = [compare(one) for one in collected]
        results["by_concurrency"][str(concurrency)] = row
    return results


def main() -> None:
    results = asyncio.run(run())
    low, high = (results["by_concurrency"][str(c)] for c in CONCURRENCY)
    lines = [
        f"Per-turn latency, {TURNS}-turn agents, max_tokens={MAX_TOKENS}, tiny-moe on the embedded engine (CPU), "
        "interleaved rounds each way: "
        + ", ".join(f"{n} at concurrency {c}" for c, n in ROUNDS.items())
        + f"; {PASSES} passes over both, pooled (each pass's figures below the table); sessions deleted after "
        "their agent's last turn, as the agentic rollout does.",
        "",
        "| concurrency | direct p50 / p99 (ms) | session p50 / p99 (ms) | added p50 / p99 (ms) "
        "| added p99 / direct p99 | turns/s direct / session | throughput ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for concurrency, row in results["by_concurrency"].items():
        direct, session = row["direct"], row["session"]
        lines.append(
            f"| {concurrency} | {direct['p50_ms']} / {direct['p99_ms']} | {session['p50_ms']} / {session['p99_ms']} "
            f"| {row['added_p50_ms']} / {row['added_p99_ms']} | {row['added_p99_fraction']:.1%} "
            f"| {direct['turns_per_s']} / {session['turns_per_s']} | {row['throughput_ratio']:.2f} |"
        )
    lines.append("")
    for concurrency, row in results["by_concurrency"].items():
        p50s, p99s, ratios = zip(
            *((p["added_p50_ms"], p["added_p99_fraction"], p["throughput_ratio"]) for p in row["per_pass"]), strict=True
        )
        lines.append(
            f"- concurrency {concurrency}, per pass: added p50 {', '.join(map(str, p50s))} ms; added p99 / direct p99 "
            f"{', '.join(f'{x:.1%}' for x in p99s)}; throughput ratio {', '.join(f'{x:.2f}' for x in ratios)}"
        )
    lines += [
        "",
        f"Targets: added p50 at concurrency 1 < 1 ms: {low['added_p50_ms']} ms; added p99 at "
        f"{CONCURRENCY[-1]} < 10% of direct: {high['added_p99_fraction']:.1%}; throughput at {CONCURRENCY[-1]} "
        f">= 90% of direct: {high['throughput_ratio']:.0%}.",
    ]
    print(write_result("session_latency", results, lines))


if __name__ == "__main__":
    main()
