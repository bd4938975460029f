"""The @hydra.main entry used for sweeps, so Hydra's launchers (basic, submitit, Slurm) run each job.

A failed job prints its report, as a single run does, and the sweep goes on: the job returns its exit code
instead of raising, so Hydra's launcher starts the next job. Ctrl-C stops the whole sweep. When the jobs ran in
this process, the sweep ends with its summary (cli/sweep_summary.py) and exits 1 if any job did not complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from miles_runner.cli.pipeline import EXIT_INTERRUPTED, execute, plan_and_record
from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.config.compose import CONF_DIR, from_hydra_job, register_base

_PLAN_ONLY = False
_DEBUG = False
_SWEEP_DIR: Path | None = None  # set by the first job that runs in this process


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_job(cfg) -> int:
    global _SWEEP_DIR
    hc = HydraConfig.get()
    composed = from_hydra_job(cfg, hc, list(hc.overrides.task))
    run_dir = Path(hc.runtime.output_dir)
    plan = plan_and_record(composed, run_dir, list(hc.overrides.task))
    if _PLAN_ONLY:
        return 0
    _SWEEP_DIR = Path(hc.sweep.dir)
    code = execute(plan, run_dir, debug=_DEBUG)
    if code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt  # Ctrl-C meant the sweep, not only this job
    return code  # a failed job has printed its report; the summary lists it and sets the sweep's exit code


def launch_multirun(overrides: list[str], *, plan_only: bool, debug: bool = False) -> int:
    global _PLAN_ONLY, _DEBUG, _SWEEP_DIR
    _PLAN_ONLY, _DEBUG, _SWEEP_DIR = plan_only, debug, None
    register_base()
    sys.argv = ["miles-run", "--multirun", *overrides]
    code = 0
    try:
        hydra_job()
    except SystemExit as stop:  # Hydra reports its own errors, then exits
        code = stop.code if isinstance(stop.code, int) else 1
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if _SWEEP_DIR is None:  # --plan, or no job ran here: nothing to summarise
        return code
    summary = summarize_sweep(_SWEEP_DIR)
    print(render_summary(summary))
    return code or summary.exit_code
