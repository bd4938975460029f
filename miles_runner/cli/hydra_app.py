"""The @hydra.main entry used for sweeps, so Hydra's launchers (basic, submitit, Slurm) run each job."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from miles_runner.cli.pipeline import execute, plan_and_record
from miles_runner.config.compose import CONF_DIR, from_composed, job_tree, register_base

_PLAN_ONLY = False
_DEBUG = False


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_job(cfg) -> None:
    hc = HydraConfig.get()
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra/")}
    composed = from_composed(job_tree(cfg), choices, list(hc.overrides.task), list(hc.searchpath))
    run_dir = Path(hc.runtime.output_dir)
    plan = plan_and_record(composed, run_dir, list(hc.overrides.task))
    if not _PLAN_ONLY and (code := execute(plan, run_dir, debug=_DEBUG)):
        sys.exit(code)  # a job the run stopped (its error is printed) fails, as a raised one would


def launch_multirun(overrides: list[str], *, plan_only: bool, debug: bool = False) -> int:
    global _PLAN_ONLY, _DEBUG
    _PLAN_ONLY, _DEBUG = plan_only, debug
    register_base()
    sys.argv = ["miles-run", "--multirun", *overrides]
    hydra_job()
    return 0
