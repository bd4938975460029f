"""One rank of the two-process Megatron multi-LoRA test: run multi_lora_case on the given layout and write rank 0's
result, with the error an odd per-slot sample count raises (argv: model, starts file, layout as JSON, output)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from miles_runner.trainer.megatron import parallel
from tests.trainer.megatron.multi_lora_case import load_json_layout, multi_case


def main(model_path: str, starts: str, layout: str, out_file: str) -> None:
    dist.init_process_group("gloo")
    out = multi_case(model_path, load_json_layout(layout), torch.load(starts), odd_batch=True)
    if dist.get_rank() == 0:
        torch.save(out, out_file)
    parallel.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
