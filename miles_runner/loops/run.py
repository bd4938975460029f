"""The one dispatcher: a plan runs the single-adapter loop or the multi-LoRA loop.

`miles-run` calls `run_plan` after planning; `python -m miles_runner.loops.run RUN_DIR [--resume]` runs a
recorded plan (RUN_DIR/plan.yaml), which is the plan's own trainer line.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_runner.core.run_lock import hold_run_folder
from miles_runner.loops.multi_lora import MultiLoRALoop
from miles_runner.loops.single_adapter import SingleAdapterLoop
from miles_runner.plan.model import Plan
from miles_runner.plan.record import read_plan
from miles_runner.plan.secrets import require_run_key


def run_plan(plan: Plan, run_dir: Path, *, resume: bool = False) -> list[dict[str, Any]]:
    """Train as the plan says; returns the step records (metrics.jsonl holds the same). A keyed run whose key
    is not in the environment is refused before anything starts; so is a second driver in the same run folder
    (core/run_lock.py)."""
    require_run_key(plan.security.api_key_env)
    loop = MultiLoRALoop if plan.capabilities.multi_lora else SingleAdapterLoop
    with hold_run_folder(run_dir):
        return loop(plan, Path(run_dir), resume=resume).run()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m miles_runner.loops.run", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--resume", action="store_true", help="go on from the run folder's latest checkpoints")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    run_plan(read_plan(args.run_dir / "plan.yaml"), args.run_dir, resume=args.resume)


if __name__ == "__main__":
    main()
