"""trainer.backend picks the trainer a plan runs: trainer=megatron builds the Megatron trainer with the plan's
layout and qkv format, trainer=fsdp the FSDP trainer, and both give the same log probabilities."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.models.format_pretrain import ensure_format_pretrained
from miles_runner.plan.compile import compile_plan
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.fsdp import FSDPTrainer
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.ranks import build_trainer

ONE_RANK = ("topology.actor_num_gpus_per_node=1",)
SAMPLES = [
    Sample([1, 60, 61, 62, 70 + k, 2], 2, [1, 1], [], None, SampleStatus.COMPLETED, reward=float(k)) for k in range(2)
]


def test_trainer_backend_picks_the_trainer_the_plan_runs():
    ensure_format_pretrained("tiny-moe")
    megatron_plan = compile_plan(
        compose([*ONE_RANK, "trainer=megatron", "lora_mode=raw", "trainer.parallel.qkv_format=bshd"])
    )
    ours = build_trainer(megatron_plan)
    assert isinstance(ours, MegatronTrainer)
    assert ours.layout == parallel.Layout.from_plan(megatron_plan) and ours.net.qkv_format == "bshd"
    fsdp = build_trainer(compile_plan(compose(list(ONE_RANK))))
    assert isinstance(fsdp, FSDPTrainer)
    for a, b in zip(ours.compute_log_probs(SAMPLES), fsdp.compute_log_probs(SAMPLES), strict=True):
        assert a == pytest.approx(b, abs=1e-5)
