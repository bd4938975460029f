"""R3 bytes per session: full R3 on every turn against incremental R3, for 10 and 50 turns.

The minimum is every routing row sent once: (len(final tokens) - 1) x num_layers x top_k x 4 bytes.
Plays the same greedy conversation through a full-R3 and an incremental-R3 session server and sums the raw
routing bytes the engine sent back over all records. Writes bench/results/session_r3_bytes.json and its
section of bench/REPORT.md.

    .venv/bin/python -m bench.session_r3_bytes
"""

from __future__ import annotations

import base64

import httpx

from bench.report import write_result
from bench.session_latency import engine_and_session_server
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.session.config import read_num_layers

TURN_COUNTS = (10, 50)
MAX_TOKENS = 8


def play(server_url: str, turns: int) -> dict:
    session_id = httpx.post(f"{server_url}/sessions").json()["session_id"]
    messages: list[dict] = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"What is {turn} plus 4?"})
        body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        reply = httpx.post(f"{server_url}/sessions/{session_id}/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
    return httpx.get(f"{server_url}/sessions/{session_id}", timeout=60).json()


def routing_bytes(session: dict) -> tuple[int, int]:
    """(raw bytes, base64 characters on the wire) of all routing payloads of a session."""
    payloads = [r["response"]["choices"][0]["meta_info"].get("routed_experts") or "" for r in session["records"]]
    return sum(len(base64.b64decode(p)) for p in payloads), sum(len(p) for p in payloads)


def main() -> None:
    num_layers = read_num_layers(ensure_tiny_model("tiny-moe"))
    engine_flags = ["--enable-return-routed-experts"]
    rows = []
    with engine_and_session_server(["--routed-experts"], engine_flags) as (_, full_url):
        full = {turns: play(full_url, turns) for turns in TURN_COUNTS}
    with engine_and_session_server(["--addition-r3"], engine_flags) as (_, incremental_url):
        incremental = {turns: play(incremental_url, turns) for turns in TURN_COUNTS}
    for turns in TURN_COUNTS:
        final_ids = incremental[turns]["metadata"]["accumulated_token_ids"]
        first = incremental[turns]["records"][0]
        rows_0 = len(first["request"]["input_ids"]) + first["response"]["usage"]["completion_tokens"] - 1
        row_bytes = len(base64.b64decode(first["response"]["choices"][0]["meta_info"]["routed_experts"])) // rows_0
        full_raw, full_wire = routing_bytes(full[turns])
        inc_raw, inc_wire = routing_bytes(incremental[turns])
        rows.append(
            {
                "turns": turns,
                "final_tokens": len(final_ids),
                "same_tokens_in_both_modes": final_ids == full[turns]["metadata"]["accumulated_token_ids"],
                "minimum_bytes": (len(final_ids) - 1) * row_bytes,
                "incremental_bytes": inc_raw,
                "full_bytes": full_raw,
                "incremental_base64_chars": inc_wire,
                "full_base64_chars": full_wire,
                "full_over_incremental": round(full_raw / inc_raw, 2),
            }
        )
    results = {"num_layers": num_layers, "max_tokens": MAX_TOKENS, "sessions": rows}
    lines = [
        f"Raw R3 bytes per session (tiny-moe, {num_layers} layers, greedy, max_tokens={MAX_TOKENS}).",
        "",
        "| turns | final tokens | minimum (each row once) | incremental | full every turn | full / incremental |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['turns']} | {row['final_tokens']} | {row['minimum_bytes']} | {row['incremental_bytes']} "
            f"| {row['full_bytes']} | {row['full_over_incremental']}x |"
        )
    print(write_result("session_r3_bytes", results, lines))


if __name__ == "__main__":
    main()
