"""One gloo rank of the distributed-whitening test: whiten this rank's values with every rank's statistics.

Run as a script with the torchrun environment variables set; writes its result to OUT_DIR/rank{RANK}.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles_runner.trainer.advantages import masked_whiten

# Rank 0 holds two trained tokens (and one masked), rank 1 one trained token.
VALUES = {0: ([[1.0, 3.0, 100.0]], [[1.0, 1.0, 0.0]]), 1: ([[5.0, -7.0, 0.0]], [[1.0, 0.0, 0.0]])}


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    values, mask = (torch.tensor(v) for v in VALUES[rank])
    torch.save(masked_whiten(values, mask, dist.all_reduce), Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
