"""Where this process stands among the trainer ranks (no process group: rank 0 of 1)."""

from __future__ import annotations

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """This process's trainer rank and the number of ranks (0, 1 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
