"""The trainer's megatron parallel layout and megatron's process groups for it.

``Layout`` is the model-parallel shape (tensor, expert, expert-tensor, pipeline parallel and sequence parallel);
data parallelism is what remains of the world. ``initialize`` builds megatron's groups over an existing
torch.distributed world (gloo on CPU), or a one-rank gloo world on loopback when there is none, and seeds the
model-parallel RNG streams; ``destroy`` undoes it (the world it created included).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.trainer.megatron.cpu_compat import apply_cpu_adaptations

_OWN_WORLD = False  # initialize() created the torch.distributed world, so destroy() ends it


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    sp: bool = False  # sequence parallel: norms, residuals and routers see 1/tp of the sequence

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "etp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} = {getattr(self, name)} must be >= 1")
        if self.sp and self.tp == 1:
            raise ValueError("Layout.sp needs tp > 1 (sequence parallelism splits the sequence over the TP ranks)")

    @classmethod
    def from_plan(cls, plan: Any) -> Layout:
        """The plan's trainer parallelism; sequence parallel whenever TP > 1 (megatron requires it for MoE with TP,
        and it is exact for dense models too)."""
        parallel = plan.trainer.parallel
        if getattr(parallel, "cp", 1) != 1:
            raise ValueError(
                f"trainer.parallel.cp = {parallel.cp}: the megatron trainer has no context parallelism "
                "on its local layer spec; use cp=1"
            )
        return cls(tp=parallel.tp, ep=parallel.ep, etp=parallel.etp, pp=parallel.pp, sp=parallel.tp > 1)

    def model_parallel_size(self) -> int:
        return self.tp * self.pp


def _ensure_world() -> None:
    global _OWN_WORLD
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", init_method=f"tcp://{LOOPBACK}:{free_port()}", world_size=1, rank=0)
    _OWN_WORLD = True


def initialize(layout: Layout, seed: int = 0) -> None:
    """megatron's model-parallel groups for ``layout`` over the current world, and its RNG streams seeded."""
    from megatron.core import parallel_state, tensor_parallel

    apply_cpu_adaptations()
    _ensure_world()
    world = dist.get_world_size()
    if world % layout.model_parallel_size() or world % (layout.ep * layout.etp * layout.pp):
        raise ValueError(
            f"world size {world} is not divisible by tp*pp = {layout.model_parallel_size()} and "
            f"ep*etp*pp = {layout.ep * layout.etp * layout.pp} (layout {layout})"
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=10,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy() -> None:
    """Tear megatron's groups down (and the world, when ``initialize`` created it)."""
    global _OWN_WORLD
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _OWN_WORLD and dist.is_initialized():
        dist.destroy_process_group()
        _OWN_WORLD = False


def data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def data_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()


def data_parallel_group() -> Any:
    """The ranks that hold the same dense weights and split the batch (what dense LoRA gradients average over)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def layout_record(layout: Layout) -> dict[str, Any]:
    """What optimizer shards depend on: the model-parallel layout and the rank count (a resume must match it)."""
    return {**dataclasses.asdict(layout), "world_size": dist.get_world_size()}
