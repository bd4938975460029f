"""Multi-LoRA throughput on one embedded CPU engine with 1, 2 and 4 adapters.

- Engine rate: the producer alone (`GroupProducer` + the multi-LoRA rollout over /generate, each adapter in
  its own engine slot) with its groups drained at once, as if the trainer were infinitely fast: generated
  tokens/s and groups/s. This is what multi-LoRA batching on the engine costs.
- Training loop: the real multi-LoRA driver (controller service, producer, multi-LoRA trainer, broadcast
  sync), the same total number of adapter steps in each case: trained groups/s, and the producer's token
  rate, which the trainer's pace bounds there.
- The scheduler's own cost per batch: `collect_batch` on buffers that already hold every group (no waiting).

    python -m bench.multi_lora_throughput [--adapter-steps N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import write_result
from miles_runner.procs.ports import free_port

ADAPTER_COUNTS = (1, 2, 4)
RBS, N = 4, 8  # groups per adapter step, samples per group
MAX_RESPONSE_LEN = 16


def plan_run(output_root: Path, adapters: int, steps_each: int) -> Path:
    from miles_runner.cli.main import single_run

    runs = ", ".join(f"{{name: a{i}, task: count}}" for i in range(adapters))
    args = [
        "+recipe=tiny_multi_lora",
        f"adapters.runs=[{runs}]",
        f"algorithm.num_steps={steps_each}",
        f"rollout.rollout_batch_size={RBS}",
        f"rollout.n_samples_per_prompt={N}",
        f"rollout.max_response_len={MAX_RESPONSE_LEN}",
        "checkpoint.interval=0",
        "logger=none",
        f"engine.base_port={free_port()}",
        f"adapters.api_port={free_port()}",
        f"run.output_root={output_root}",
    ]
    assert single_run(args, plan_only=True, argv=args) == 0
    [plan] = output_root.rglob("plan.yaml")
    return plan.parent


def run_case(adapters: int, adapter_steps: int) -> dict[str, Any]:
    from miles_runner.loops.multi_lora import MultiLoRALoop
    from miles_runner.plan.record import read_plan

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = plan_run(Path(tmp) / "outputs", adapters, adapter_steps // adapters)
        records = MultiLoRALoop(read_plan(run_dir / "plan.yaml"), run_dir).run()
    steady = records[1:]  # the first record has no previous one to rate tokens against
    loop_s = sum(r["batch/collect_seconds"] + r["train/seconds"] + r["sync/seconds"] for r in steady)
    groups = sum(v for r in steady for k, v in r.items() if k.endswith("/groups"))
    return {
        "adapters": adapters,
        "iterations": len(records),
        "tokens_per_s": statistics.mean(r["rollout/tokens_per_s"] for r in steady),
        "trained_groups_per_s": groups / loop_s,
        "collect_s_mean": statistics.mean(r["batch/collect_seconds"] for r in steady),
        "train_s_mean": statistics.mean(r["train/seconds"] for r in steady),
        "sync_s_mean": statistics.mean(r["sync/seconds"] for r in steady),
    }


def engine_rate(adapters: int, seconds: float, warmup_s: float = 3.0) -> dict[str, float]:
    """Tokens/s and groups/s the producer gets from one engine serving `adapters` slots at once."""

    from miles_runner.plan.record import read_plan
    from miles_testkit.contract import build_contract_adapter
    from miles_testkit.launch import embedded_engine_argv, start_engine

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = plan_run(Path(tmp) / "outputs", adapters, 1)
        plan = read_plan(run_dir / "plan.yaml")
        adapter = build_contract_adapter(Path(plan.model_path), Path(tmp) / "lora")
        port = free_port()
        slots = [f"__miles_slot_{k}={adapter}" for k in range(adapters)]
        argv = embedded_engine_argv(
            plan.model_path, port, "--enable-lora", "--max-loras-per-batch", "4", "--lora-paths", *slots
        )
        engine = start_engine(argv, port=port, log_path=Path(tmp) / "engine.log", timeout_s=180)
        try:
            return asyncio.run(_produce(plan, run_dir, f"http://127.0.0.1:{port}", seconds, warmup_s))
        finally:
            engine.stop()


async def _produce(plan, run_dir: Path, url: str, seconds: float, warmup_s: float) -> dict[str, float]:
    from miles_runner.multi_lora.buffers import AdapterBuffers
    from miles_runner.multi_lora.cache import AdaptersCache, in_process
    from miles_runner.multi_lora.producer import GroupProducer
    from miles_runner.multi_lora.settings import settings_from_plan
    from miles_runner.rollout.context import RolloutContext
    from miles_runner.rollout.multi_lora import MultiLoRARollout
    from miles_runner.sglang_client.engine_pool import EnginePool

    controller = settings_from_plan(plan, run_dir).build_controller()
    controller.record_weight_update([a.name for a in plan.adapters])
    cache = AdaptersCache(in_process(controller.snapshot))
    buffers = AdapterBuffers(dp_size=1, max_staleness=None)
    async with EnginePool.for_deployment(None, [url]) as workers:  # the loop's pool (rollout_engines), no router
        rollout = MultiLoRARollout(RolloutContext.from_plan(plan, workers, None), cache, seed=plan.seed)
        producer = GroupProducer(
            cache, buffers, rollout.next_prompt, rollout.generate_group, concurrency=2 * plan.multi_lora.slots
        )
        producer.start()
        await asyncio.sleep(warmup_s)
        groups, tokens, started = 0, rollout.tokens_generated, time.perf_counter()
        while time.perf_counter() - started < seconds:
            await asyncio.sleep(0.01)
            groups += sum(len(buffer.get(len(buffer))) for buffer in buffers.buffers.values())  # drain
        elapsed = time.perf_counter() - started
        await producer.stop()
    tokens = rollout.tokens_generated - tokens
    if not groups:  # a producer that died logs why and stops; a rate of 0 would pass for a figure
        raise RuntimeError(f"the producer made no groups in {elapsed:.1f} s; see the log above")
    return {"engine_tokens_per_s": tokens / elapsed, "engine_groups_per_s": groups / elapsed}


def scheduler_overhead_s(adapters: int, batches: int = 200) -> float:
    """Seconds per `collect_batch` when every group is already buffered: the scheduler's own cost."""
    from miles_runner.multi_lora.buffers import AdapterBuffers, Group
    from miles_runner.multi_lora.collect import collect_batch
    from miles_runner.multi_lora.config import AdapterRunConfig
    from miles_runner.multi_lora.registry import AdapterRun, RegistrySnapshot
    from miles_runner.session.samples import Sample, SampleStatus

    def config(name: str) -> AdapterRunConfig:
        return AdapterRunConfig(
            task="count",
            reward="exact_match",
            rank=8,
            alpha=16.0,
            target_modules=("q_proj",),
            lr=1e-3,
            rollout_batch_size=RBS,
            n_samples_per_prompt=N,
            save=f"/tmp/{name}",
        )

    runs = {
        f"a{i}": AdapterRun(f"a{i}", config(f"a{i}"), slot=i, version=1, registration_id=f"r{i}")
        for i in range(adapters)
    }
    snapshot = RegistrySnapshot(active=runs)
    sample = Sample([1, 2, 3], 1, [1], [-0.5], None, SampleStatus.COMPLETED)

    async def measure() -> float:
        buffers = AdapterBuffers(dp_size=1, max_staleness=1, maxlen=batches * RBS + 1)
        for run in runs.values():
            for index in range(batches * RBS):
                buffers.put(Group(run.name, index, [sample] * N, run.slot, 1, run.registration_id))
        started = time.perf_counter()
        for _ in range(batches):
            await collect_batch(buffers, snapshot, target_samples=RBS * N, coalesce_wait_s=0.0, empty_wait_s=1.0)
        return (time.perf_counter() - started) / batches

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapter-steps", type=int, default=16, help="adapter steps per case, all adapters together")
    parser.add_argument("--engine-seconds", type=float, default=20.0, help="measuring time of each engine-rate case")
    args = parser.parse_args()
    cases = []
    for n in ADAPTER_COUNTS:
        case = {**engine_rate(n, args.engine_seconds), **run_case(n, args.adapter_steps)}
        case["scheduler_overhead_ms"] = 1000 * scheduler_overhead_s(n)
        cases.append(case)
    base = cases[0]["engine_tokens_per_s"]
    for case in cases:
        case["engine_tokens_vs_one_adapter"] = case["engine_tokens_per_s"] / base
    rows = [
        f"| {c['adapters']} | {c['engine_tokens_per_s']:.1f} | {c['engine_tokens_vs_one_adapter']:.2f} | "
        f"{c['engine_groups_per_s']:.2f} | {c['trained_groups_per_s']:.2f} | {c['tokens_per_s']:.1f} | "
        f"{c['scheduler_overhead_ms']:.3f} | {c['collect_s_mean']:.3f} | {c['train_s_mean']:.3f} | "
        f"{c['sync_s_mean']:.3f} |"
        for c in cases
    ]
    four = cases[-1]["engine_tokens_vs_one_adapter"]
    summary = [
        "`python -m bench.multi_lora_throughput` (tiny-moe format-pretrained, one embedded CPU engine, task count, "
        f"{RBS} groups x {N} samples per adapter step, at most {MAX_RESPONSE_LEN} new tokens). Engine: the producer "
        f"alone for {args.engine_seconds:g} s, groups drained at once (each adapter its own slot, all in one "
        "engine batch). Loop: the real multi-LoRA driver (controller service, producer, multi-LoRA trainer, "
        f"gloo broadcast sync), {args.adapter_steps} adapter steps per case; trained groups/s over collect + train "
        "+ sync time; its token rate is bounded by the trainer's pace. Scheduler: `collect_batch` with every group "
        "already buffered; collect s: its wall time in the loop, waiting included.",
        "",
        "| adapters | engine tokens/s | vs 1 adapter | engine groups/s | loop trained groups/s | loop tokens/s | "
        "scheduler ms/batch | loop collect s | loop train s | loop sync s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"4 adapters keep {four:.0%} of the 1-adapter engine token rate (target >= 80%).",
    ]
    write_result("multi_lora_throughput", {"cases": cases, "adapter_steps": args.adapter_steps}, summary)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
