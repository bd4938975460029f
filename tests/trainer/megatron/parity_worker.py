"""One rank of the megatron parity test: run each case (a model folder and a layout) and, on rank 0, save every
case's results to one file. Arguments: the output file, then JSON ``[[name, model_path, layout kwargs], ...]``."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from miles_runner.trainer.megatron.parallel import Layout
from tests.trainer.megatron.parity_case import run_case


def main(out_file: str, cases: str) -> None:
    dist.init_process_group("gloo")
    results = {name: run_case(path, Layout(**layout)) for name, path, layout in json.loads(cases)}
    if dist.get_rank() == 0:
        torch.save(results, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
