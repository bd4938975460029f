"""Push verification (weight_sync/verify.py, weight_sync/probe.py): every engine must report the pushed weight version,
and right after a push every engine's logprobs of the probe under the pushed adapter must match the trainer's within the
plan's tolerance. Two real embedded engines; the trainer side is peft on the base model with the adapter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from miles_runner.sglang_client.client import EngineClient
from miles_runner.weight_sync.probe import PushProbe, mean_gap, probe_body, probe_token_ids
from miles_runner.weight_sync.tensor_sync import TensorSync
from miles_runner.weight_sync.verify import SyncVerificationError, check_engine_versions

from .conftest import Adapter, lora_engine
from .engine_probe import is_paused, served_adapters

pytestmark = pytest.mark.integration

MAX_GAP = 0.01  # the embedded engine's default weight_sync.max_logprob_gap


class VersionDroppingClient(EngineClient):
    """Fault injection: an engine client whose weight-version update never reaches the engine."""

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> dict:
        return {"success": True}


class AdapterKeepingClient(EngineClient):
    """Fault injection: an engine client whose reloads of an adapter never reach the engine (it keeps the first
    weights it got under that name), while its weight version is updated as usual."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept: set[str] = set()

    async def unload_lora_adapter(self, name: str) -> dict:
        return {"success": True}

    async def load_lora_adapter_from_tensors(self, name: str, *args, **kwargs) -> dict:
        if name in self.kept:
            return {"success": True}
        self.kept.add(name)
        return await super().load_lora_adapter_from_tensors(name, *args, **kwargs)


# ---- the engines report the pushed version --------------------------------------------------------------


async def test_every_engine_reporting_the_pushed_version_passes(client):
    await client.update_weight_version("7")
    await check_engine_versions([client], 7)


async def test_an_engine_on_another_version_is_named_with_the_version_it_reports(client):
    await client.update_weight_version("7")
    with pytest.raises(SyncVerificationError, match=rf"version 8 .*engine {client.base_url} reports '7'"):
        await check_engine_versions([client], 8)


async def test_a_push_whose_version_an_engine_drops_fails_and_leaves_the_engine_running(
    client, engine_url_for_sync, colocated_plan, adapters
):
    first, _ = adapters
    await client.update_weight_version("0")
    async with VersionDroppingClient(engine_url_for_sync, timeout_s=60) as faulty:
        sync = TensorSync([faulty], colocated_plan, "dropped_lora")
        try:
            with pytest.raises(SyncVerificationError, match=f"engine {engine_url_for_sync}"):
                await sync.push(first.tensors, first.config, version=5)
            assert not await is_paused(faulty)  # continue_generation ran although the push failed
        finally:
            if "dropped_lora" in await served_adapters(faulty):
                await faulty.unload_lora_adapter("dropped_lora")


async def test_a_verified_push_reports_the_seconds_its_check_took(client, colocated_plan, adapters):
    first, _ = adapters
    sync = TensorSync([client], colocated_plan, "checked_lora")
    try:
        report = await sync.push(first.tensors, first.config, version=4)
        assert 0 < report.verify_seconds < report.seconds
    finally:
        await client.unload_lora_adapter("checked_lora")


# ---- the push probe: every engine against the trainer, right after the push ------------------------------


@pytest.fixture(scope="session")
def second_engine_url(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from lora_engine(tiny_moe_dir, tmp_path_factory.mktemp("probe_engine"))


@pytest.fixture(scope="session")
def probe_ids(tiny_moe_dir: Path) -> list[int]:
    return probe_token_ids(tiny_moe_dir)


def trainer_log_probs(model_dir: Path, adapter: Adapter, token_ids: list[int]) -> list[float]:
    """What the trainer holding `adapter` scores for the probe: peft on the fp32 base model, temperature 1."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_runner.trainer.logprobs import sequence_log_probs

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sequence_log_probs(PeftModel.from_pretrained(base, adapter.path).eval(), token_ids)


def test_the_probe_is_a_few_dozen_tokens_of_fixed_text_and_a_valid_native_generate(probe_ids, tiny_moe_dir):
    assert 24 <= len(probe_ids) <= 96 and probe_ids == probe_token_ids(tiny_moe_dir)  # the same for every push
    body = probe_body(probe_ids, "policy")
    assert body["logprob_start_len"] == 0 and body["sampling_params"] == {"max_new_tokens": 1, "temperature": 1.0}


def test_the_gap_is_the_mean_absolute_difference_and_needs_the_same_tokens():
    assert mean_gap([-1.0, -2.0], [-1.5, -2.5]) == pytest.approx(0.5)
    with pytest.raises(SyncVerificationError, match="same tokens"):
        mean_gap([-1.0], [-1.0, -2.0])


async def test_a_healthy_push_passes_the_probe_on_every_engine(
    engine_url_for_sync, second_engine_url, colocated_plan, adapters, tiny_moe_dir, probe_ids
):
    first, _ = adapters
    mine = trainer_log_probs(tiny_moe_dir, first, probe_ids)
    async with EngineClient(engine_url_for_sync, timeout_s=60) as a, EngineClient(second_engine_url, timeout_s=60) as b:
        sync = TensorSync([a, b], colocated_plan, "probed_lora")
        try:
            await sync.push(first.tensors, first.config, version=21)
            report = await PushProbe([a, b], probe_ids, MAX_GAP).check(mine, "probed_lora", what="step 20")
            print(f"probe gaps {report.gaps}, {report.seconds:.3f} s")
            assert len(report.gaps) == 2 and max(report.gaps) < 1e-4  # fp32 on both sides
        finally:
            for engine in (a, b):
                await engine.unload_lora_adapter("probed_lora")


async def test_an_engine_that_keeps_the_old_adapter_fails_the_probe_by_name(
    engine_url_for_sync, second_engine_url, colocated_plan, adapters, tiny_moe_dir, probe_ids
):
    first, second = adapters
    mine = trainer_log_probs(tiny_moe_dir, second, probe_ids)
    async with (
        EngineClient(engine_url_for_sync, timeout_s=60) as healthy,
        AdapterKeepingClient(second_engine_url, timeout_s=60) as stuck,
    ):
        sync = TensorSync([healthy, stuck], colocated_plan, "kept_lora")
        try:
            await sync.push(first.tensors, first.config, version=30)
            await sync.push(second.tensors, second.config, version=31)  # the versions cannot tell: both say 31
            with pytest.raises(SyncVerificationError) as caught:
                await PushProbe([healthy, stuck], probe_ids, MAX_GAP).check(mine, "kept_lora", what="step 30")
            message = str(caught.value)
            print(message)
            assert message.startswith("step 30: the probe of adapter 'kept_lora'")
            assert f"engine {second_engine_url} differs by" in message and engine_url_for_sync not in message
        finally:
            await healthy.unload_lora_adapter("kept_lora")
            await EngineClient.unload_lora_adapter(stuck, "kept_lora")  # the engine itself, past the fault
