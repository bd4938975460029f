"""A CPU plan's trainer rank computes on one intra-op thread, as the embedded engine does: each holds one CPU slot,
and two OpenMP threads per op wait at a barrier for a core another process is using (bench/single_turn_step.py)."""

from __future__ import annotations

import torch

from miles_runner.config.compose import compose
from miles_runner.models.format_pretrain import ensure_format_pretrained
from miles_runner.plan.compile import compile_plan
from miles_runner.trainer.ranks import build_trainer


def test_a_cpu_plans_trainer_computes_on_one_intra_op_thread():
    ensure_format_pretrained("tiny-moe")
    plan = compile_plan(compose(["session=off"]))
    assert plan.cluster.cpu_only
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        build_trainer(plan)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
