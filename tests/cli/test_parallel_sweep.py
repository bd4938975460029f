"""A sweep's points side by side on one machine (Hydra's joblib launcher): each point chooses its own ports where it
starts ("auto", the default), writes its own run folder, and the sweep ends with the same summary as one run after
another."""

import json

import pytest

from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.plan.model import PORTS_FILE
from miles_runner.tracking.job_result import COMPLETED
from tests.drivers import run_short_sweep


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_points_run_side_by_side_on_their_own_ports_and_end_with_the_summary(tmp_path):
    done, console, sweep = run_short_sweep(
        tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "+recipe=tiny_lora_agentic", "run.seed=1,2"
    )
    assert done.returncode == 0, console
    ports = [json.loads((sweep / job / PORTS_FILE).read_text()) for job in ("0", "1")]
    assert set(ports[0]) == set(ports[1]) == {"engine0", "session"}
    assert not set(ports[0].values()) & set(ports[1].values()), "each point binds its own ports"

    summary = summarize_sweep(sweep, write=False)
    assert [(job.number, job.status, job.steps) for job in summary.jobs] == [(0, COMPLETED, 2), (1, COMPLETED, 2)]
    assert done.stdout.rstrip().endswith(render_summary(summary)), done.stdout
    started = [json.loads((sweep / job / "startup.json").read_text()) for job in ("0", "1")]
    first_ends = min(stamps["loop_ended"] for stamps in started)
    assert all(stamps["loop_started"] < first_ends for stamps in started), "the points ran at the same time"
