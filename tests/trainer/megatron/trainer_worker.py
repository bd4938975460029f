"""One rank of the two-process Megatron trainer tests: train one step of test_trainer's samples from the given
starting adapter on the given layout, and write rank 0's adapter and metrics (argv: model, start adapter, layout as
JSON, qkv format, output file)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from tests.trainer.megatron.test_trainer import samples, settings_from


def main(model_path: str, start: str, layout: str, qkv_format: str, out_file: str) -> None:
    dist.init_process_group("gloo")
    trainer = MegatronTrainer(
        model_path, settings_from(Path(start)), parallel.Layout(**json.loads(layout)), qkv_format=qkv_format
    )
    metrics = trainer.train(samples())
    state = trainer.adapter_state()
    if dist.get_rank() == 0:
        torch.save({"adapter": state, "metrics": metrics}, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
