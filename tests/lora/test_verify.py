"""Push verification (lora/verify.py): every engine must report the pushed weight version, and the first samples
generated since a push must match the trainer's logprobs within the plan's tolerance."""

from __future__ import annotations

import re

import pytest

from miles_runner.engine.client import EngineClient
from miles_runner.lora.tensor_sync import TensorSync
from miles_runner.lora.verify import GapCheck, SyncVerificationError, check_engine_versions, logprob_gap
from miles_runner.session.samples import Sample, SampleStatus

from .engine_probe import is_paused, served_adapters

ENGINE = "http://127.0.0.1:30010"


def sample(rollout: list[float], versions: list[str], mask: list[int] | None = None) -> Sample:
    n = len(rollout)
    return Sample(tokens=[1, 2, *range(3, 3 + n)], response_length=n, loss_mask=mask or [1] * n,
                  rollout_log_probs=rollout, rollout_routed_experts=None, status=SampleStatus.COMPLETED,
                  weight_versions=versions)  # fmt: skip


class VersionDroppingClient(EngineClient):
    """Fault injection: an engine client whose weight-version update never reaches the engine."""

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> dict:
        return {"success": True}


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


# ---- the logprob gap of the first samples since a push ---------------------------------------------------


def test_the_gap_is_the_mean_absolute_difference_over_trained_tokens_only():
    samples = [sample([-1.0, -2.0], ["1"], mask=[1, 0]), sample([-1.0], ["1"])]
    assert logprob_gap(samples, [[-1.5, -9.0], [-0.5]]) == pytest.approx(0.5)


def test_only_samples_generated_entirely_since_the_push_are_checked():
    check = GapCheck(0.01, [ENGINE])
    old, straddling, fresh, later = (sample([-1.0], v) for v in (["1"], ["1", "2"], ["2"], ["3"]))
    assert check.fresh([old, straddling, fresh]) == []  # nothing is pending before a push
    check.pushed(2)
    assert check.fresh([old, straddling, fresh, later]) == [fresh, later]


def test_a_gap_within_the_tolerance_passes_and_clears_the_pending_push():
    check = GapCheck(0.01, [ENGINE])
    check.pushed(2)
    fresh = [sample([-1.0, -2.0], ["2"])]
    assert check.check(fresh, [[-1.001, -2.001]], what="step 2") == pytest.approx(0.001)
    assert check.fresh(fresh) == []


def test_a_gap_beyond_the_tolerance_stops_with_the_step_version_and_engine():
    check = GapCheck(0.01, [ENGINE])
    check.pushed(3)
    with pytest.raises(SyncVerificationError, match=rf"step 3: .*version 3 \(by engine {ENGINE}\).* 0\.5 .*0\.01"):
        check.check([sample([-1.0], ["3"])], [[-1.5]], what="step 3")


def test_every_engine_that_served_the_batch_is_named():
    check = GapCheck(0.01, [ENGINE, "http://127.0.0.1:30011"])
    check.pushed(1)
    with pytest.raises(SyncVerificationError, match=re.escape(f"engines {ENGINE}, http://127.0.0.1:30011")):
        check.check([sample([-1.0], ["1"])], [[-2.0]], what="step 1")


def test_samples_without_rollout_logprobs_cannot_be_verified():
    with pytest.raises(SyncVerificationError, match="no rollout logprobs"):
        logprob_gap([sample([], ["1"])], [[-1.0]])
