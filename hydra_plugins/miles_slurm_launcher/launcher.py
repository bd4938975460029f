"""The launcher: each job's plan is compiled and recorded in its job folder (plan.yaml, what the job script runs),
the sweep goes to Slurm as one job array, and a manifest is left in the sweep folder. Submit-and-exit by
default (each JobReturn holds the job's Slurm id); with wait=true it blocks until every job ended and returns
their results (a job that did not complete is a failed JobReturn)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

from hydra_plugins.miles_slurm_launcher.config import MilesSlurmLauncherConf  # noqa: F401  (registers the entry)
from miles_runner.cli.pipeline import plan_and_record
from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.config.compose import from_hydra_job
from miles_runner.core.errors import PlanError
from miles_runner.slurm.contradictions import executor_problems, settings_problems, with_executor
from miles_runner.slurm.jobs import JobState, format_states, wait_for_jobs
from miles_runner.slurm.settings import SlurmSettings, settings_from
from miles_runner.slurm.submit import PlannedJob, submit_array
from miles_runner.tracking.job_result import COMPLETED


class MilesSlurmLauncher(Launcher):
    def __init__(self, **params: Any) -> None:
        self.settings: SlurmSettings = settings_from(params)
        self.config: DictConfig | None = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None, "Hydra calls setup() before launch()"
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        jobs, configs = [], []
        for idx, overrides in enumerate(job_overrides):
            job, sweep_config = self.plan_job(list(overrides), initial_job_idx + idx)
            jobs.append(job)
            configs.append(sweep_config)
        manifest = submit_array(sweep_dir, jobs, self.settings, self.settings.python or sys.executable)
        print(
            f"miles-run: submitted {len(jobs)} job(s) as Slurm job array {manifest.array_job_id}; "
            f"sweep folder {sweep_dir}\n  miles-run --status {sweep_dir}",
            flush=True,
        )
        if not self.settings.wait:
            return [
                submitted_return(job, cfg, m.job_id) for job, cfg, m in zip(jobs, configs, manifest.jobs, strict=True)
            ]
        states = wait_for_jobs(manifest, self.settings.poll_interval_s)
        print(f"{format_states(states)}\n\n{render_summary(summarize_sweep(sweep_dir))}", flush=True)
        return [job_return(job, cfg, state) for job, cfg, state in zip(jobs, configs, states, strict=True)]

    def plan_job(self, overrides: list[str], num: int) -> tuple[PlannedJob, DictConfig]:
        """Compose the job's config as Hydra would for it, compile and record its plan in its job folder."""
        if problems := executor_problems(overrides):
            raise PlanError(problems)
        overrides = with_executor(overrides)
        sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = num
        HydraConfig.instance().set_config(sweep_config)
        hc = sweep_config.hydra
        job_dir = Path(str(hc.sweep.dir)) / str(hc.sweep.subdir)
        job_dir.mkdir(parents=True, exist_ok=True)
        composed = from_hydra_job(sweep_config, hc, overrides)
        plan = plan_and_record(composed, job_dir, overrides)
        if problems := settings_problems(plan, self.settings):
            raise PlanError(problems)
        return PlannedJob(job_dir, overrides, plan), sweep_config


def submitted_return(job: PlannedJob, cfg: DictConfig, job_id: str) -> JobReturn:
    """Submit-and-exit: the job's Slurm id is its return value."""
    return JobReturn(
        overrides=job.overrides, cfg=cfg, working_dir=str(job.job_dir), status=JobStatus.COMPLETED, _return_value=job_id
    )


def job_return(job: PlannedJob, cfg: DictConfig, state: JobState) -> JobReturn:
    if state.result is not None and state.result.status == COMPLETED:
        return JobReturn(
            overrides=job.overrides,
            cfg=cfg,
            working_dir=str(job.job_dir),
            status=JobStatus.COMPLETED,
            _return_value=state.result,
        )
    why = state.result.status if state.result else f"Slurm state {state.state}"
    return JobReturn(
        overrides=job.overrides,
        cfg=cfg,
        working_dir=str(job.job_dir),
        status=JobStatus.FAILED,
        _return_value=RuntimeError(
            f"job {state.job.job_id} did not complete ({why}); its log: {job.job_dir / 'slurm.out'}"
        ),
    )
