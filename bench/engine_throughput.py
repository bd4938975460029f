"""Embedded engine throughput: generated tokens/s at concurrency 1, 4 and 16 over HTTP, and the HTTP server's
overhead against driving the same engine in-process.

    .venv/bin/python -m bench.engine_throughput [--requests-per-client 4] [--max-new-tokens 64]

Writes bench/results/engine_throughput.json and updates the "Embedded engine throughput" section of
bench/REPORT.md. Each client sends its requests one after another (greedy, ignore_eos, fixed length), so
tokens/s = all generated tokens / wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench.report import write_result
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.procs.ports import free_port
from miles_testkit.launch import embedded_engine_argv

CONCURRENCY = (1, 4, 16)
PROMPT_IDS = [5, 6, 7, 8, 9, 10, 11, 12]


def _body(max_new_tokens: int, client: int) -> dict:
    prompt = [*PROMPT_IDS, 20 + client]  # distinct prompts, same length
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": prompt, "sampling_params": params}


async def _http_rate(url: str, concurrency: int, per_client: int, max_new_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as http:

        async def client(index: int) -> int:
            tokens = 0
            for _ in range(per_client):
                response = await http.post("/generate", json=_body(max_new_tokens, index))
                tokens += response.json()["meta_info"]["completion_tokens"]
            return tokens

        await client(0)  # warm-up
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i) for i in range(concurrency))))
        return tokens / (time.perf_counter() - started)


async def _in_process_rate(model_dir: Path, concurrency: int, per_client: int, max_new_tokens: int) -> float:
    from miles_runner.embedded_engine.args import parse_args
    from miles_runner.embedded_engine.engine import EmbeddedEngine
    from miles_runner.embedded_engine.protocol import GenerateReqInput

    engine = EmbeddedEngine(parse_args(["--model-path", str(model_dir)]))
    await engine.start()

    async def client(index: int) -> int:
        tokens = 0
        for _ in range(per_client):
            requests, _ = engine.build_generate_requests(GenerateReqInput(**_body(max_new_tokens, index)))
            async for _i, result in engine.generate(requests):
                if result.finish_reason is not None:
                    tokens += len(result.output_ids)
        return tokens

    try:
        await client(0)
        started = time.perf_counter()
        tokens = sum(await asyncio.gather(*(client(i) for i in range(concurrency))))
        return tokens / (time.perf_counter() - started)
    finally:
        engine.shutdown()


def start_server(model_dir: Path, log, *flags: str) -> tuple[subprocess.Popen, str]:
    """An embedded engine on a free loopback port (the model's defaults, plus `flags`), once healthy."""
    port = free_port()
    cmd = embedded_engine_argv(model_dir, port, *flags)
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("engine did not become healthy")


def measure(per_client: int, max_new_tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)  # as the server does
    model_dir = ensure_tiny_model("tiny-moe")
    with tempfile.TemporaryFile("w+") as log:
        process, url = start_server(model_dir, log)
        try:
            http = {c: asyncio.run(_http_rate(url, c, per_client, max_new_tokens)) for c in CONCURRENCY}
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(30)
    in_process = {c: asyncio.run(_in_process_rate(model_dir, c, per_client, max_new_tokens)) for c in (1, 16)}
    return {
        "model": "tiny-moe (Qwen3-MoE, 2 layers, hidden 64, 8 experts, top-2)",
        "max_new_tokens": max_new_tokens,
        "requests_per_client": per_client,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
        "http_tokens_per_s": {str(c): round(r, 1) for c, r in http.items()},
        "speedup_16_vs_1": round(http[16] / http[1], 2),
        "in_process_tokens_per_s": {str(c): round(r, 1) for c, r in in_process.items()},
        "http_overhead_pct_at_1": round(100 * (1 - http[1] / in_process[1]), 1),
        "http_overhead_pct_at_16": round(100 * (1 - http[16] / in_process[16]), 1),
    }


def write_report(results: dict) -> None:
    rates = results["http_tokens_per_s"]
    lines = [
        f"`python -m bench.engine_throughput` ({results['model']}, {results['max_new_tokens']} new tokens per request,"
        f" {results['cpu_count']} CPUs, 1-min load {results['load_average_1m']:.1f}):",
        "",
        "| concurrency | HTTP tokens/s |",
        "|---|---|",
        *[f"| {c} | {rate} |" for c, rate in rates.items()],
        "",
        f"Speed-up at 16 vs 1: {results['speedup_16_vs_1']}x (target >= 4x). In-process engine (no HTTP): "
        f"{results['in_process_tokens_per_s']['1']} tok/s at 1, {results['in_process_tokens_per_s']['16']} at 16; "
        f"HTTP overhead {results['http_overhead_pct_at_1']}% at 1, {results['http_overhead_pct_at_16']}% at 16.",
    ]
    write_result("engine_throughput", results, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    results = measure(args.requests_per_client, args.max_new_tokens)
    write_report(results)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
