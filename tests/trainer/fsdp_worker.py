"""One rank of the FSDP2 (gloo) test: train one step, write the full adapter from rank 0.

Run as `python -m tests.trainer.fsdp_worker` from the repository root, with the torchrun environment variables set;
an optional third argument is JSON: TrainerSettings overrides, with "algorithm" holding AlgorithmConfig overrides
and "responses" replacing RESPONSES.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from miles_runner.config.schema import AlgorithmConfig, OptimizerConfig
from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.fsdp import FSDPTrainer
from tests.trainer.settings import make_settings

PROMPT = [1, 60, 61, 62, 63, 4]
RESPONSES = ([70, 71, 2], [90, 91, 2], [70, 2], [91, 2])
REWARDS = (1.0, 0.0, 0.5, 0.0)


def samples(responses=RESPONSES) -> list[Sample]:
    return [
        Sample(PROMPT + r, len(r), [1] * len(r), [], None, SampleStatus.COMPLETED, reward=w)
        for r, w in zip(responses, REWARDS, strict=True)
    ]


def main(model_path: str, out_file: str, options: str = "{}") -> None:
    dist.init_process_group("gloo")
    overrides = json.loads(options)
    algorithm = replace(AlgorithmConfig(), **overrides.pop("algorithm", {}))
    responses = overrides.pop("responses", RESPONSES)
    # SGD: the update is proportional to the gradient, so a wrong reduction across ranks shows.
    settings = make_settings(optimizer=OptimizerConfig(name="sgd", lr=0.5), algorithm=algorithm, **overrides)
    trainer = FSDPTrainer(model_path, settings)
    trainer.train(samples(responses))
    state = trainer.adapter_state()
    checkpoint = trainer.state_dict()
    trainer.save_adapter(Path(out_file).parent / "adapter")
    if dist.get_rank() == 0:
        torch.save({"adapter": state, "step": checkpoint["step"]}, out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
