"""The megatron parallel layout: validation, the plan's parallelism, and megatron's groups on a one-rank world."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles_runner.plan.model import Parallelism
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.parallel import Layout


def plan_with(**sizes) -> SimpleNamespace:
    shape = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 1, **sizes}
    world = shape["tp"] * shape["pp"] * shape["cp"] * shape["dp"]
    return SimpleNamespace(
        trainer=SimpleNamespace(parallel=Parallelism(**shape, world_size=world, micro_batch_size=1, qkv_format="thd"))
    )


def test_the_plans_parallelism_is_the_layout_with_sequence_parallel_under_tp():
    assert Layout.from_plan(plan_with(tp=2, ep=2, dp=2)) == Layout(tp=2, ep=2, sp=True)
    assert Layout.from_plan(plan_with(ep=2, dp=2)) == Layout(ep=2)
    with pytest.raises(ValueError, match="cp = 2"):
        Layout.from_plan(plan_with(cp=2))


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="sp needs tp > 1"):
        Layout(sp=True)
    with pytest.raises(ValueError, match=r"Layout\.ep = 0"):
        Layout(ep=0)
    with pytest.raises(ValueError, match="world size 1 is not divisible"):
        parallel.initialize(Layout(tp=2, sp=True))
    parallel.destroy()


def test_initialize_on_a_one_rank_world_and_destroy():
    import torch.distributed as dist

    parallel.initialize(Layout())
    try:
        assert dist.get_world_size() == 1
        assert (parallel.data_parallel_rank(), parallel.data_parallel_size()) == (0, 1)
    finally:
        parallel.destroy()
    assert not dist.is_initialized()  # the world initialize() created went with it
