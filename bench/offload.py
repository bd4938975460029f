"""Offload: the memory an engine and a trainer give back and take again, what it costs a step, and the logprob gap
after a resume.

- engine: one embedded engine process (`--enable-memory-saver`) serving the Qwen2.5-0.5B-shaped 2-layer model of
  bench/adapter_sync_bandwidth.py (about 30M parameters, 116 MB in float32), with and without
  `--enable-weights-cpu-backup`. Each cycle is the colocated loop's (docs/system.md §7): a batch of generations (its
  KV kept in the prefix cache), release every tag, resume the weights, resume the rest, one greedy request. The
  resident memory is what the engine reports in /server_info: before the release, after it, and after that request
  (weights reloaded from safetensors are mapped file pages, resident once a forward reads them); the logprob gap is
  the largest |difference| of that request's token logprobs before the first cycle and after each.
- trainer: the Megatron trainer (raw LoRA r16 on every linear) on the same model, after one training step (Adam
  state and gradients present): its state offloaded and onloaded a few times to each target; the resident memory
  of this process before, after the offload, and after the onload and one forward (safetensors maps the chunks it
  reads back: their pages become resident as the forward reads them).
- loop: `tiny_lora_agentic` (single turn, a small batch) for a few steps with `topology.offload_rollout` on and off:
  the step seconds, and the seconds the offload calls take (`offload/seconds`), medians.

Writes bench/results/offload.json and its section of bench/REPORT.md.

    .venv/bin/python -m bench.offload [--cycles 6] [--steps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.adapter_sync_bandwidth import ensure_model
from bench.report import write_result
from miles_runner.core.host_memory import rss_bytes
from miles_runner.core.sglang_protocol import WEIGHTS_TAG, offload_tags
from miles_runner.procs.ports import free_port
from miles_runner.sglang_client.client import EngineClient
from miles_testkit.launch import embedded_engine_argv, start_engine

MB = 2**20
LINEAR_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TAGS = offload_tags(["kv_cache", "weight"])
BATCH = {"input_ids": [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(8)], "sampling_params": {"max_new_tokens": 32}}
PROBE = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}}
LOOP_BASE = (
    "+recipe=tiny_lora_agentic",
    "session=off",
    "rollout.max_turns=1",
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=2",
    "logger=none",
)


async def rss(client: EngineClient) -> int:
    [state] = (await client.server_info())["internal_states"]
    return int(state["memory_occupation"]["rss_bytes"])


async def probe_logprobs(client: EngineClient) -> list[float]:
    result = await client.generate({**PROBE, "return_logprob": True})
    return [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


async def engine_cycles(url: str, cycles: int) -> dict[str, Any]:
    rows = []
    async with EngineClient(url, timeout_s=300) as client:
        before = await probe_logprobs(client)
        for _ in range(cycles):
            await client.generate(BATCH)
            resident = await rss(client)
            started = time.perf_counter()
            await client.release_memory_occupation(TAGS)
            release_s, released = time.perf_counter() - started, await rss(client)
            started = time.perf_counter()
            await client.resume_memory_occupation([WEIGHTS_TAG])
            await client.resume_memory_occupation([t for t in TAGS if t != WEIGHTS_TAG])
            resume_s = time.perf_counter() - started
            after = await probe_logprobs(client)  # reloaded weights are file pages until a forward touches them
            restored = await rss(client)
            gap = max(abs(a - b) for a, b in zip(after, before, strict=True))
            rows.append(
                {
                    "released_mb": (resident - released) / MB,
                    "restored_mb": (restored - released) / MB,
                    "release_s": release_s,
                    "resume_s": resume_s,
                    "logprob_gap": gap,
                }
            )
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]} | {
        "max_logprob_gap": max(r["logprob_gap"] for r in rows)
    }


def engine(model: Path, cycles: int, *flags: str) -> dict[str, Any]:
    port = free_port()
    argv = embedded_engine_argv(model, port, "--enable-memory-saver", *flags)
    process = start_engine(argv, port=port, log_path=Path(tempfile.mkdtemp()) / "engine.log", timeout_s=300)
    try:
        return asyncio.run(engine_cycles(f"http://127.0.0.1:{port}", cycles))
    finally:
        process.stop()


def trainer_cycles(model: Path, target: str, cycles: int) -> dict[str, float]:
    """The Megatron trainer's state out and back `cycles` times (after one step, so the optimizer has state)."""
    from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
    from miles_runner.core.adapters import AdapterSpec
    from miles_runner.session.samples import Sample, SampleStatus
    from miles_runner.trainer.megatron import parallel
    from miles_runner.trainer.megatron.trainer import MegatronTrainer
    from miles_runner.trainer.policy_trainer import TrainerSettings
    from miles_runner.trainer.train_offload import OffloadSettings

    adapter = AdapterSpec("bench", "bench", 16, 32.0, 0.0, LINEAR_TARGETS, "arith", "exact_match", 1e-3, 2, 2)
    offload = OffloadSettings(target, tempfile.mkdtemp(prefix="train-offload-"))
    settings = TrainerSettings(adapter, AlgorithmConfig(), OptimizerConfig(), 2, 0, 2, offload=offload)
    trainer = MegatronTrainer(model, settings, parallel.Layout())
    tokens = [[1, 60 + i, 61, 62, 63, 70 + i, 71, 2] for i in range(2)]
    trainer.train(
        [Sample(t, 3, [1] * 3, [], None, SampleStatus.COMPLETED, reward=float(i)) for i, t in enumerate(tokens)]
    )
    rows = []
    for _ in range(cycles):
        resident, started = rss_bytes(), time.perf_counter()
        moved = trainer.offload_state()["moved_bytes"]
        offload_s, released = time.perf_counter() - started, rss_bytes()
        started = time.perf_counter()
        trainer.onload_state()
        onload_s = time.perf_counter() - started
        trainer.probe_log_probs(tokens[0])  # chunks read back are mapped file pages, resident once a forward reads them
        rows.append(
            {
                "moved_mb": moved / MB,
                "released_mb": (resident - released) / MB,
                "restored_mb": (rss_bytes() - released) / MB,
                "offload_s": offload_s,
                "onload_s": onload_s,
            }
        )
    parallel.destroy()
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


def loop(steps: int, *overrides: str) -> dict[str, float]:
    from miles_runner.cli.main import single_run
    from miles_runner.loops.run import run_plan
    from miles_runner.plan.record import read_plan

    root = Path(tempfile.mkdtemp(prefix="engine-offload-"))
    args = [*LOOP_BASE, f"algorithm.num_steps={steps}", f"run.output_root={root}", *overrides]
    assert single_run(args, plan_only=True, argv=args) == 0
    [plan] = root.rglob("plan.yaml")
    records = run_plan(read_plan(plan), plan.parent)[1:]  # the first step also pays the start-up's warm-up
    medians = {"step_s": statistics.median(r["step/seconds"] for r in records)}
    if "offload/seconds" in records[0]:
        medians["offload_s"] = statistics.median(r["offload/seconds"] for r in records)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    model = ensure_model()
    figures = {
        "engine_reload": engine(model, args.cycles),
        "engine_cpu_backup": engine(model, args.cycles, "--enable-weights-cpu-backup"),
        "trainer_disk": trainer_cycles(model, "disk", args.cycles),
        "trainer_cpu": trainer_cycles(model, "cpu", args.cycles),
        "loop_offload": loop(args.steps, "topology.offload_rollout=true"),
        "loop_resident": loop(args.steps),
    }
    reload, backup = figures["engine_reload"], figures["engine_cpu_backup"]
    on, off = figures["loop_offload"], figures["loop_resident"]
    lines = [
        f"Engine: Qwen2.5-0.5B-shaped, 2 layers (116 MB of float32 weights), {args.cycles} cycles, medians.",
        "",
        "| weights come back | resident MB released | MB restored | release s | resume s | max logprob gap |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {f['released_mb']:.1f} | {f['restored_mb']:.1f} | {f['release_s']:.3f} | "
            f"{f['resume_s']:.3f} | {f['max_logprob_gap']:.1e} |"
            for name, f in (("reloaded from the model path", reload), ("from the CPU backup", backup))
        ),
        "",
        f"Trainer: the Megatron trainer (raw LoRA r16 on every linear), the same model, {args.cycles} cycles, medians.",
        "",
        "| target | MB moved | resident MB released | MB restored | offload s | onload s |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {f['moved_mb']:.1f} | {f['released_mb']:.1f} | {f['restored_mb']:.1f} | "
            f"{f['offload_s']:.3f} | {f['onload_s']:.3f} |"
            for name, f in (
                ("disk", figures["trainer_disk"]),
                ("cpu (a CPU host: nothing moves)", figures["trainer_cpu"]),
            )
        ),
        "",
        f"Loop: `tiny_lora_agentic` single turn, {args.steps} steps (the first left out), medians: a step takes "
        f"{on['step_s']:.2f} s with rollout offload and {off['step_s']:.2f} s without; the offload calls take "
        f"{on['offload_s']:.3f} s of it.",
    ]
    write_result("offload", figures, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
