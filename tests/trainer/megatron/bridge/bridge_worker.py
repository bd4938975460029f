"""One rank of the two-process Megatron-Bridge tests: run each case (bridge_case.run_case) and save this rank's
results. Arguments: the output folder, then JSON ``[{"name", "model", "layout", ...run_case options}, ...]``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from miles_runner.trainer.megatron.parallel import Layout
from tests.trainer.megatron.bridge.bridge_case import run_case


def main(out_dir: str, cases: str) -> None:
    dist.init_process_group("gloo")
    results = {}
    for case in json.loads(cases):
        export_dir = Path(out_dir) / case["name"]
        results[case["name"]] = run_case(case["model"], Layout(**case["layout"]), export_dir, **case.get("options", {}))
    torch.save(results, Path(out_dir) / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
