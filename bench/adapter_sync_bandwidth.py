"""Adapter sync bandwidth: seconds against adapter bytes, for both sync paths, against a plain memory copy.

Model: the shape of Qwen2.5-0.5B (hidden 896, intermediate 4864, 14 heads, 2 KV heads) with 2 layers and
seeded random weights, built here once (cached). Its vocabulary is the tiny models' tokenizer (about 400
tokens) instead of Qwen's 151,936: an all-linear adapter never touches the embeddings, and the small vocabulary
keeps the model at about 30M parameters, so the engine starts in seconds on 2 cores.

Adapters: LoRA r = 8, 16, 64 on every linear layer (q, k, v, o, gate, up, down), as recipes/qwen25_05b_lora.yaml
trains them, float32 as the CPU trainer exports them, random A and B.

Paths, each the real sync class of the runner against one real embedded engine process:
- tensor hand-off (weight_sync/tensor_sync.py TensorSync, colocated plan), as the runner does it for an engine on its
  host with a one-rank FSDP trainer: the trainer's adapter parameters live in a shared-memory segment
  (TensorSync.share) and the request carries a handle to it (sglang_client/tensor_shm.py, the CPU analogue of SGLang's
  CUDA IPC handles): one copy, the engine's, from the trainer's memory into its adapter weights;
- tensor copied (the same sync, for tensors that are copies: the Megatron trainer's and multi-rank FSDP exports):
  each push first writes them into a hand-off segment the sync rewrites, then the engine copies them out;
- tensor inline (TensorSync with shared_memory=False, what an engine on another host gets): the tensors travel in
  the HTTP request as base64 safetensors;
- broadcast (weight_sync/broadcast.py BroadcastSync, disaggregated CPU plan): gloo broadcast into the running engine.

Per rank and path: `push` is the whole sync protocol a train step pays (pause, flush, unload, load, version,
verify, continue); `load` is the adapter's own trip (serialize or broadcast, HTTP, install in the engine).
The copy baseline is a numpy copy of a buffer of the same bytes into fresh memory (what any hand-off must at
least do), measured in the same run; at these sizes it runs within the caches (the smaller adapters fit in L2),
so the memory copy bandwidth (a buffer far larger than the caches) is shown beside it. GB/s = adapter
bytes / median seconds. `marginal` is the slope of a least-squares line through the fastest run of each rank
(bytes per extra second), so that fixed per-sync costs (HTTP requests on loopback) do not hide
the per-byte cost; the copy's own marginal, through its fastest runs of the same byte counts, is what it is
compared with (seconds against bytes, both ways). The target is judged on the adapter's own trip (`load`), by
that slope. Writes bench/results/adapter_sync_bandwidth.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.adapter_sync_bandwidth [--repeats 40]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.report import write_result
from miles_runner.core.paths import model_cache_dir
from miles_runner.plan.model import Plan
from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import EngineClient
from miles_runner.weight_sync.adapter_sync import AdapterSync, tensor_bytes
from miles_runner.weight_sync.broadcast import BroadcastSync
from miles_runner.weight_sync.tensor_sync import TensorSync
from miles_testkit.launch import embedded_engine_argv, engine_url, start_engine

RANKS = (8, 16, 64)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN25_05B_SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
)
NUM_LAYERS = 2
MODEL_NAME = f"qwen2.5-0.5b-shape-{NUM_LAYERS}layers-seed0"
MEMORY_COPY_BYTES = 256 * 2**20
PATHS = ("tensor", "tensor_copied", "tensor_inline", "broadcast")
ROUNDS = 4  # the repeats of each rank are spread over this many rounds (measure_path)
TARGET_FRACTION = 0.30  # the goal: sync at >= 30% of the copy bandwidth
ADAPTER = "bench_adapter"
DISAGGREGATED = ("topology=disaggregated", "topology.rollout_num_gpus=1", "topology.actor_num_gpus_per_node=1")


def ensure_model() -> Path:
    """The Qwen2.5-0.5B-shaped model folder, built once (seeded) into the model cache."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from miles_runner.models.tiny_model import build_tokenizer

    target = model_cache_dir() / MODEL_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    vocab_size = build_tokenizer(staging)
    token_ids = json.loads((staging / "tokenizer.json").read_text())["model"]["vocab"]
    config = Qwen2Config(
        **QWEN25_05B_SHAPE,
        num_hidden_layers=NUM_LAYERS,
        vocab_size=vocab_size,
        tie_word_embeddings=True,
        eos_token_id=token_ids["<|im_end|>"],
        pad_token_id=token_ids["<|endoftext|>"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def make_adapter(model_dir: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(peft state dict, adapter config dict) of a random all-linear LoRA of `rank`, as the trainer exports it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(rank)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    model = get_peft_model(base, config)
    tensors = {name: t.detach().clone() for name, t in get_peft_model_state_dict(model).items()}
    return tensors, json.loads(json.dumps(model.peft_config["default"].to_dict(), default=list))


def plan(*overrides: str) -> Plan:
    from miles_runner.config.compose import compose
    from miles_runner.plan.compile import compile_plan

    return compile_plan(compose(list(overrides)))


def copy_seconds(nbytes: int, repeats: int) -> tuple[float, float]:
    """Median and least seconds of a numpy copy of `nbytes` into fresh memory: the plain-copy baseline (numpy's
    copy is one memcpy on one thread; torch's clone, spread over threads, runs far slower on a busy 2-core
    machine)."""
    source = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    times = timings(source.copy, repeats * 4)
    return statistics.median(times), min(times)


def memory_copy_gbs(repeats: int) -> float:
    """GB/s of a numpy copy of MEMORY_COPY_BYTES, far beyond the caches: the machine's memory copy bandwidth. The
    adapters (1.5-12 MB) copy within the caches, at several times this rate."""
    source = np.ones(MEMORY_COPY_BYTES, dtype=np.uint8)
    return MEMORY_COPY_BYTES / statistics.median(timings(source.copy, repeats)) / 1e9


def timings(call: Callable[[], Any], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


async def seconds_of(call: Callable[[], Awaitable[Any]], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return times


async def measure_path(
    sync: AdapterSync, adapters: dict[int, tuple], repeats: int, *, shared: bool = False
) -> dict[int, dict[str, float]]:
    """Push and load seconds per rank (median, and min: the least disturbed run on a busy machine). The repeats
    of each rank are spread over ROUNDS rounds in alternating rank order, so that a slow spell of the machine
    does not fall on one rank alone and tilt the marginal slope. Each round's first push of a rank is untimed:
    the rank change rebuilds the engine's adapter (and the first joins the broadcast group). `shared`: the
    tensors move into the sync's shared memory first, as the trainer's parameters do, and every push sends
    them from there."""
    times: dict[int, dict[str, list[float]]] = {rank: {"push": [], "load": []} for rank in adapters}
    versions = itertools.count(1)
    per_round = -(-repeats // ROUNDS)
    for round_index in range(ROUNDS):
        for rank in list(adapters)[:: 1 if round_index % 2 == 0 else -1]:
            tensors, config = adapters[rank]
            if shared:
                assert isinstance(sync, TensorSync)
                tensors = sync.share(tensors)
                assert tensors is not None, "the engine on this host does not read shared memory"
            report = await sync.push(tensors, config, next(versions))
            assert report.shared_memory == shared
            calls = {
                "push": functools.partial(_push, sync, tensors, config, versions),
                "load": functools.partial(sync.load, tensors, config, ADAPTER),
            }
            for kind, call in calls.items():
                times[rank][kind] += await seconds_of(call, per_round)
    figures: dict[int, dict[str, float]] = {}
    for rank, by_kind in times.items():
        figures[rank] = {}
        for kind, seconds in by_kind.items():
            figures[rank] |= {f"{kind}_seconds": statistics.median(seconds), f"{kind}_min_seconds": min(seconds)}
    return figures


async def _push(sync: AdapterSync, tensors: dict, config: dict, versions: Iterator[int]) -> None:
    await sync.push(tensors, config, next(versions))


def marginal_bandwidth(byte_counts: list[int], seconds: list[float]) -> float | None:
    """Bytes per second of the least-squares slope of seconds over bytes; None when the seconds do not rise with
    the bytes (noise larger than the per-byte cost)."""
    slope = float(np.polyfit(np.array(byte_counts, float), np.array(seconds, float), 1)[0])
    # A rise over the whole byte range within rounding of the seconds is no rise (least squares on equal
    # seconds can give a slope of +1e-18 rather than 0, depending on the LAPACK path).
    rise = slope * (max(byte_counts) - min(byte_counts))
    return None if rise <= 1e-9 * max(seconds) else 1 / slope


async def run(model_dir: Path, repeats: int) -> dict[str, Any]:
    adapters = {rank: make_adapter(model_dir, rank) for rank in RANKS}
    port = free_port()
    argv = embedded_engine_argv(
        model_dir,
        port,
        "--enable-lora",
        "--max-lora-rank",
        str(max(RANKS)),
        "--lora-target-modules",
        *TARGETS,
        "--dist-timeout",
        "120",
    )
    logs = Path(tempfile.mkdtemp(prefix="adapter-sync-bench-"))
    engine = start_engine(argv, port=port, log_path=logs / "engine.log", timeout_s=300)
    try:
        async with EngineClient(engine_url(argv, port), timeout_s=300) as client:
            syncs = {
                "tensor": TensorSync([client], plan(), ADAPTER),
                "tensor_copied": TensorSync([client], plan(), ADAPTER),
                "tensor_inline": TensorSync([client], plan(), ADAPTER, shared_memory=False),
                "broadcast": BroadcastSync([client], plan(*DISAGGREGATED), ADAPTER, timeout_s=120),
            }
            measured = {}
            for path, sync in syncs.items():
                try:
                    measured[path] = await measure_path(sync, adapters, repeats, shared=path == "tensor")
                    await client.unload_lora_adapter(ADAPTER)
                finally:
                    await sync.close()
    finally:
        engine.stop()
    rows = []
    for rank, (tensors, _) in adapters.items():
        nbytes = tensor_bytes(tensors)
        copy_median, copy_min = copy_seconds(nbytes, repeats)
        rows.append(
            {
                "rank": rank,
                "bytes": nbytes,
                "tensors": len(tensors),
                "copy_seconds": copy_median,
                "copy_min_seconds": copy_min,
                **{path: measured[path][rank] for path in PATHS},
            }
        )
    model = {"name": MODEL_NAME, **QWEN25_05B_SHAPE, "num_hidden_layers": NUM_LAYERS}
    return {
        "ranks": list(RANKS),
        "repeats": repeats,
        "memory_copy_gbs": memory_copy_gbs(repeats),
        "model": model,
        "target_modules": TARGETS,
        "rows": rows,
    }


def add_bandwidths(figures: dict[str, Any]) -> None:
    """GB/s and fraction of the copy bandwidth of every measured seconds figure, plus the marginal ones."""
    for row in figures["rows"]:
        copy_gbs = row["bytes"] / row["copy_seconds"] / 1e9
        row["copy_gbs"] = copy_gbs
        for path in PATHS:
            for kind in ("push", "load"):
                gbs = row["bytes"] / row[path][f"{kind}_seconds"] / 1e9
                row[path][f"{kind}_gbs"], row[path][f"{kind}_fraction_of_copy"] = gbs, gbs / copy_gbs
    byte_counts = [row["bytes"] for row in figures["rows"]]
    copy_rate = marginal_bandwidth(byte_counts, [row["copy_min_seconds"] for row in figures["rows"]])
    # A copy whose seconds did not rise with the bytes (noise): its median per-rank rate stands in.
    copy_gbs = copy_rate / 1e9 if copy_rate else statistics.median(row["copy_gbs"] for row in figures["rows"])
    figures["copy_marginal_gbs"] = copy_gbs
    figures["marginal"] = {}
    for path in PATHS:
        for kind in ("push", "load"):
            seconds = [row[path][f"{kind}_min_seconds"] for row in figures["rows"]]  # the least disturbed runs
            rate = marginal_bandwidth(byte_counts, seconds)
            gbs = None if rate is None else rate / 1e9
            figures["marginal"][f"{path}_{kind}"] = {
                "gbs": gbs,
                "fraction_of_copy": None if gbs is None else gbs / copy_gbs,
                "fraction_of_memory_copy": None if gbs is None else gbs / figures["memory_copy_gbs"],
            }


def summary(figures: dict[str, Any]) -> list[str]:
    lines = [
        f"Model: the Qwen2.5-0.5B shape with {NUM_LAYERS} layers (random weights); LoRA on all linear layers, "
        "float32; one embedded engine process on loopback; medians of "
        f"{figures['repeats']} syncs per rank, over {ROUNDS} rounds with the ranks in alternating order. "
        "`push` = the whole sync protocol, `load` = the adapter's own trip. "
        "Copy = numpy copy of the same bytes into fresh memory. Paths: `tensor` = a handle in the request to the "
        "shared memory the trainer's parameters live in (an engine on the trainer's host, a one-rank FSDP trainer; "
        "one copy), `tensor_copied` = the same for tensors first written into a hand-off segment (the Megatron "
        "trainer's and multi-rank FSDP exports; two copies), `tensor_inline` = base64 safetensors in the request (an "
        "engine elsewhere), `broadcast` = gloo.",
        "",
        "| r | bytes | copy GB/s | path | push s | load s | load GB/s (% copy) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in figures["rows"]:
        for path in PATHS:
            m = row[path]
            lines.append(
                f"| {row['rank']} | {row['bytes']:,} | {row['copy_gbs']:.2f} | {path} | {m['push_seconds']:.4f} | "
                f"{m['load_seconds']:.4f} | {m['load_gbs']:.3f} ({100 * m['load_fraction_of_copy']:.1f}%) |"
            )
    lines += [
        "",
        f"Memory copy bandwidth (numpy, {MEMORY_COPY_BYTES >> 20} MB, beyond the caches): "
        f"{figures['memory_copy_gbs']:.2f} GB/s. Marginal bandwidth (slope of the fastest run of each rank over "
        f"r = 8..64, fixed per-sync costs left out), as % of the copy's own marginal over the same bytes "
        f"({figures['copy_marginal_gbs']:.2f} GB/s) / of the memory copy:",
        "",
        *(f"- {key}: {marginal_text(m)}" for key, m in figures["marginal"].items()),
        "",
        f"Target: load >= {100 * TARGET_FRACTION:.0f}% of the copy bandwidth, marginal against marginal: "
        f"{target_verdict(figures)}.",
    ]
    return lines


def marginal_text(marginal: dict[str, float | None]) -> str:
    if marginal["gbs"] is None:
        return "n/a (the seconds did not rise with the bytes: noise above the per-byte cost)"
    return (
        f"{marginal['gbs']:.3f} GB/s ({100 * marginal['fraction_of_copy']:.1f}% / "
        f"{100 * marginal['fraction_of_memory_copy']:.0f}%)"
    )


def target_verdict(figures: dict[str, Any]) -> str:
    """Met or missed per path, by the marginal bandwidth of the adapter's own trip against the copy's; with the
    largest adapter's whole trip (fixed costs included) against its copy beside it."""
    largest = max(figures["rows"], key=lambda row: row["bytes"])
    verdicts = []
    for path in PATHS:
        fraction = figures["marginal"][f"{path}_load"]["fraction_of_copy"] or 0.0
        verdicts.append(
            f"{path} {'met' if fraction >= TARGET_FRACTION else 'missed'} ({100 * fraction:.1f}%; "
            f"r{largest['rank']} whole: {100 * largest[path]['load_fraction_of_copy']:.1f}%)"
        )
    return ", ".join(verdicts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # The marginal rates rest on the fastest of `repeats` runs at each rank: with too few, a busy machine leaves no
    # undisturbed run at some rank and the broadcast's slope swings from run to run.
    parser.add_argument("--repeats", type=int, default=40)
    repeats = parser.parse_args().repeats
    figures = asyncio.run(run(ensure_model(), repeats))
    add_bandwidths(figures)
    lines = summary(figures)
    write_result("adapter_sync_bandwidth", figures, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
