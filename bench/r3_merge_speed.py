"""R3 merge speed: a session's routing patches merged into one tensor, against a plain copy of the same bytes.

The session: 50 turns of a 48-layer, top-8 MoE (the shape of Qwen3-30B-A3B: 48 layers, 128 experts, top-8,
recipes/qwen3_30b_a3b_r3_session.yaml), under incremental R3, so each turn's record carries only the rows after
its checkpoint. Token counts, seeded: a first prompt of 1,024 tokens (system prompt, tool schemas, task), then
per turn a response of 128-384 tokens and, before every later turn, a tool observation of 256-512 tokens; about
33k tokens in all, an agentic run that fills a 32k context, the case where R3's bytes matter. Expert ids are
random in [0, 128).

Records are built in the session server's own record format (session/records.py: the upstream request with
`input_ids` and `routed_experts_start_len`, the response with `meta_info.routed_experts` as base64 and
`output_token_logprobs`), and merged by session/r3.py assemble_incremental_r3, what the server runs for
/samples. The copy baseline is a numpy copy of the merged tensor's bytes into fresh memory (what the merge must
at least do), measured in the same run; the copy into an already-touched buffer is shown too.
Writes bench/results/r3_merge_speed.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.r3_merge_speed [--repeats 25]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.report import write_result
from miles_runner.session.r3 import assemble_incremental_r3
from miles_runner.session.records import SessionRecord
from miles_runner.sglang_client.routed_experts import encode_routed_experts

TURNS = 50
NUM_LAYERS = 48
TOPK = 8
NUM_EXPERTS = 128
FIRST_PROMPT = 1024
RESPONSE = (128, 384)
OBSERVATION = (256, 512)
TARGET_FRACTION = 0.50  # the goal: merge at >= 50% of the copy bandwidth


def turn_lengths(turns: int, seed: int = 0) -> list[tuple[int, int]]:
    """(tokens added to the prompt, response tokens) per turn: the first prompt, then observations."""
    rng = np.random.default_rng(seed)
    added = [FIRST_PROMPT, *(int(n) for n in rng.integers(OBSERVATION[0], OBSERVATION[1] + 1, turns - 1))]
    responses = [int(n) for n in rng.integers(RESPONSE[0], RESPONSE[1] + 1, turns)]
    return list(zip(added, responses, strict=True))


def make_record(prompt_ids: list[int], output_ids: list[int], start: int, routing: np.ndarray) -> SessionRecord:
    """One turn as the session server records it under incremental R3."""
    request = {"input_ids": prompt_ids, "return_routed_experts": True, "routed_experts_start_len": start}
    meta_info = {
        "output_token_logprobs": [[-0.5, token, None] for token in output_ids],
        "routed_experts": encode_routed_experts(routing),
        "completion_tokens": len(output_ids),
    }
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "..."},
        "finish_reason": "tool_calls",
        "meta_info": meta_info,
    }
    return SessionRecord(1.0, 0.5, "POST", "/v1/chat/completions", request, {"choices": [choice]}, 200)


def session_records(turns: int = TURNS, seed: int = 0) -> tuple[list[SessionRecord], np.ndarray]:
    """The session's records and the full routing tensor they carry between them, rows [0, tokens - 1)."""
    lengths = turn_lengths(turns, seed)
    total = sum(added + response for added, response in lengths)
    rng = np.random.default_rng(seed + 1)
    routing = rng.integers(0, NUM_EXPERTS, (total - 1, NUM_LAYERS, TOPK), dtype=np.int32)
    tokens = rng.integers(0, 150_000, total).tolist()
    records, length = [], 0
    for added, response in lengths:
        prompt = tokens[: length + added]
        output = tokens[length + added : length + added + response]
        start, length = max(0, len(prompt) - added - 1), length + added + response
        records.append(make_record(prompt, output, start, routing[start : length - 1]))
    return records, routing


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(repeats: int) -> dict[str, Any]:
    records, routing = session_records()
    required_rows = len(routing)
    merged = assemble_incremental_r3(records, required_rows, NUM_LAYERS)
    if not np.array_equal(merged, routing):
        raise AssertionError("the merged routing differs from the rows the records carry")
    warm = np.empty_like(routing)
    calls = {
        "merge": lambda: assemble_incremental_r3(records, required_rows, NUM_LAYERS),
        "copy": routing.copy,
        "copy_warm": lambda: np.copyto(warm, routing),
    }
    # Interleaved, so that a busy spell of the machine slows the merge and its baseline alike.
    times: dict[str, list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            times[key].append(timed(call))
    seconds = {key: statistics.median(values) for key, values in times.items()}
    fractions = [copy / merge for copy, merge in zip(times["copy"], times["merge"], strict=True)]
    nbytes = routing.nbytes
    gbs = {key: nbytes / value / 1e9 for key, value in seconds.items()}
    return {
        "turns": TURNS,
        "num_layers": NUM_LAYERS,
        "topk": TOPK,
        "repeats": repeats,
        "tokens": required_rows + 1,
        "rows": required_rows,
        "bytes": nbytes,
        "base64_chars": sum(len(r.meta_info["routed_experts"]) for r in records),
        "seconds": seconds,
        "gbs": gbs,
        "merge_fraction_of_copy": gbs["merge"] / gbs["copy"],
        "merge_fraction_of_warm_copy": gbs["merge"] / gbs["copy_warm"],
        "merge_fraction_of_copy_per_repeat": {"min": min(fractions), "max": max(fractions)},
    }


def summary(f: dict[str, Any]) -> list[str]:
    met = "met" if f["merge_fraction_of_copy"] >= TARGET_FRACTION else "missed"
    return [
        f"{f['turns']} turns, {f['num_layers']} layers, top-{f['topk']}, {f['tokens']:,} tokens: "
        f"{f['bytes'] / 1e6:.1f} MB of routing ({f['base64_chars'] / 1e6:.1f} MB of base64 in the records); "
        f"medians of {f['repeats']}.",
        "",
        "| | seconds | GB/s |",
        "|---|---|---|",
        f"| merge (assemble_incremental_r3: decode + place every patch) | {f['seconds']['merge']:.4f} | "
        f"{f['gbs']['merge']:.2f} |",
        f"| numpy copy of the same bytes, fresh memory | {f['seconds']['copy']:.4f} | {f['gbs']['copy']:.2f} |",
        f"| numpy copy into a warm buffer | {f['seconds']['copy_warm']:.4f} | {f['gbs']['copy_warm']:.2f} |",
        "",
        f"Merge at {100 * f['merge_fraction_of_copy']:.0f}% of the copy bandwidth (medians; "
        f"{100 * f['merge_fraction_of_copy_per_repeat']['min']:.0f}-"
        f"{100 * f['merge_fraction_of_copy_per_repeat']['max']:.0f}% over the interleaved repeats; "
        f"{100 * f['merge_fraction_of_warm_copy']:.0f}% of the warm copy); target >= "
        f"{100 * TARGET_FRACTION:.0f}%: {met}.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=25)
    figures = measure(parser.parse_args().repeats)
    lines = summary(figures)
    write_result("r3_merge_speed", figures, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
