"""The @hydra.main entry used for sweeps, so Hydra's launchers (basic, submitit, Slurm) run each job.

A failed job prints its report, as a single run does, and the sweep goes on: the job returns its exit code
instead of raising, so Hydra's launcher starts the next job. Ctrl-C stops the whole sweep. When the jobs ran in
this process or in its pool (the joblib launcher runs them side by side, each on its own ports), the sweep ends
with its summary (cli/sweep_summary.py) and exits 1 if any job did not complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig

from miles_runner.cli.pipeline import EXIT_INTERRUPTED, execute, plan_and_record
from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.config.compose import CONF_DIR, from_hydra_job, register_base, resolved_sweep_dir
from miles_runner.config.hydra_settings import SWEEP_DIR_KEY, override_key, uses_slurm_launcher

_PLAN_ONLY = False
_DEBUG = False


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_job(cfg) -> int:
    hc = HydraConfig.get()
    composed = from_hydra_job(cfg, hc, list(hc.overrides.task))
    run_dir = Path(hc.runtime.output_dir)
    plan = plan_and_record(composed, run_dir, list(hc.overrides.task))
    if _PLAN_ONLY:
        return 0
    code = execute(plan, run_dir, debug=_DEBUG)
    if code == EXIT_INTERRUPTED:
        raise KeyboardInterrupt  # Ctrl-C meant the sweep, not only this job
    return code  # a failed job has printed its report; the summary lists it and sets the sweep's exit code


def pinned_sweep_dir(overrides: list[str]) -> tuple[list[str], Path]:
    """The overrides with hydra.sweep.dir resolved once, here: a launcher that runs the jobs in other processes
    (joblib's) resolves `${now:...}` in each of them, and this process summarises the folder they wrote."""
    sweep_dir = resolved_sweep_dir(overrides)
    kept = [text for text in overrides if override_key(text) != SWEEP_DIR_KEY]
    return [*kept, f"{SWEEP_DIR_KEY}='{sweep_dir}'"], Path(sweep_dir)


def launch_multirun(overrides: list[str], *, plan_only: bool, debug: bool = False) -> int:
    global _PLAN_ONLY, _DEBUG
    _PLAN_ONLY, _DEBUG = plan_only, debug
    register_base()
    sweep_dir = None
    if not plan_only and not uses_slurm_launcher(overrides):  # the jobs end here, in this process or in its pool
        overrides, sweep_dir = pinned_sweep_dir(overrides)
    sys.argv = ["miles-run", "--multirun", *overrides]
    code = 0
    try:
        hydra_job()
    except SystemExit as stop:  # Hydra reports its own errors, then exits
        code = stop.code if isinstance(stop.code, int) else 1
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    if sweep_dir is None or not sweep_dir.exists():  # --plan, Slurm's jobs, or no job ran: nothing to summarise
        return code
    summary = summarize_sweep(sweep_dir)
    print(render_summary(summary))
    return code or summary.exit_code
