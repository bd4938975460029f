"""Retiring an adapter on a real engine (the embedded CPU engine, two slots loaded): its in-flight requests end
aborted by the `name::` prefix abort, no group of it is buffered afterwards, and the other adapter goes on."""

from __future__ import annotations

import asyncio

from miles_runner.multi_lora.buffers import AdapterBuffers
from miles_runner.multi_lora.cache import AdaptersCache, in_process
from miles_runner.multi_lora.controller import MultiLoRAController
from miles_runner.multi_lora.producer import GroupProducer, request_fields
from miles_runner.multi_lora.registry import AdapterRun
from miles_runner.session.samples import STATUS_OF_FINISH, Sample, SampleStatus
from miles_runner.sglang_client.client import EngineClient
from miles_runner.sglang_client.engine_pool import fixed_engines

from .helpers import LIMITS, defaults, eventually, sample

LONG, SHORT = 1500, 4  # new tokens: "slow" requests stay in flight until aborted; "fast" ones finish


def engine_generate_group(
    engine: EngineClient, cache: AdaptersCache, new_tokens: dict[str, int], finishes: list[tuple[str, str]]
):
    """A generate function over the engine's native /generate, gated by `request_fields` before each POST;
    it records (adapter, finish reason) of every answer."""

    async def one(run: AdapterRun, prompt: list[int]) -> Sample:
        fields = await request_fields(cache, run)
        if fields is None:
            return sample(status=SampleStatus.ABORTED)
        params = {"max_new_tokens": new_tokens[run.name], "ignore_eos": True, "temperature": 1.0}
        out = await engine.generate({"input_ids": prompt, "sampling_params": params, **fields})
        finishes.append((run.name, out["meta_info"]["finish_reason"]["type"]))
        status = STATUS_OF_FINISH.get(out["meta_info"]["finish_reason"]["type"], SampleStatus.COMPLETED)
        return sample(prompt + out["output_ids"], status)

    async def generate(run: AdapterRun, prompt: list[int]) -> list[Sample]:
        return list(await asyncio.gather(*(one(run, prompt) for _ in range(run.config.n_samples_per_prompt))))

    return generate


async def test_retiring_aborts_its_in_flight_requests_and_spares_the_other_adapter(engine_url, tmp_path):
    controller = MultiLoRAController(defaults(str(tmp_path)), LIMITS, fixed_engines([engine_url]))
    for name in ("slow", "fast"):
        controller.register_adapter(name, {})
    controller.record_weight_update(["slow", "fast"])
    cache = AdaptersCache(in_process(controller.snapshot), ttl_s=0.0)
    buffers = AdapterBuffers(dp_size=1, max_staleness=None)
    finishes: list[tuple[str, str]] = []
    async with EngineClient(engine_url, timeout_s=120) as engine:
        generate = engine_generate_group(engine, cache, {"slow": LONG, "fast": SHORT}, finishes)
        producer = GroupProducer(
            cache,
            buffers,
            lambda run, index: [10 + run.slot, 20 + index % 50],
            generate,
            concurrency=4,
            max_backlog_groups=2,
        )
        producer.start()
        try:
            await eventually(lambda: buffers.buffered("fast") >= 1, timeout_s=60)
            assert buffers.buffered("slow") == 0  # its groups are still decoding
            controller.deregister_adapter("slow")
            assert await controller.retire_adapters() == ["slow"]
            await eventually(lambda: buffers.dropped["slow", "aborted"] >= 2, timeout_s=30)
            buffers.buffers["fast"].get(100)
            await eventually(lambda: buffers.buffered("fast") >= 2, timeout_s=60)  # it goes on after the retire
        finally:
            await producer.stop()
    assert ("slow", "abort") in finishes  # ended by the engine, not cut short here
    assert ("fast", "abort") not in finishes and buffers.dropped["fast", "aborted"] == 0
    assert buffers.buffered("slow") == 0 and buffers.failure is None
