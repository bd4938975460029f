"""A sweep's points side by side on one machine (Hydra's joblib launcher): each point chooses its own ports where it
starts ("auto", the default), writes its own run folder, and the sweep ends with the same summary as one run after
another."""

import json
import subprocess

import pytest

from miles_runner.cli.sweep_summary import render_summary, summarize_sweep
from miles_runner.plan.model import PORTS_FILE
from miles_runner.tracking.job_result import COMPLETED
from tests.drivers import runner_command


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_points_run_side_by_side_on_their_own_ports_and_end_with_the_summary(tmp_path):
    done = subprocess.run(
        runner_command(
            "miles_runner.cli.main",
            "--multirun",
            "hydra/launcher=joblib",
            "hydra.launcher.n_jobs=2",
            "+recipe=tiny_lora_agentic",
            "algorithm.num_steps=2",
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=4",
            f"run.output_root={tmp_path / 'out'}",
            "logger=none",
            "run.seed=1,2",
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    console = done.stdout + done.stderr
    assert done.returncode == 0, console
    [sweep] = {p.parent.parent for p in (tmp_path / "out" / "multirun").rglob("plan.yaml")}
    ports = [json.loads((sweep / job / PORTS_FILE).read_text()) for job in ("0", "1")]
    assert set(ports[0]) == set(ports[1]) == {"engine0", "session"}
    assert not set(ports[0].values()) & set(ports[1].values()), "each point binds its own ports"

    summary = summarize_sweep(sweep, write=False)
    assert [(job.number, job.status, job.steps) for job in summary.jobs] == [(0, COMPLETED, 2), (1, COMPLETED, 2)]
    assert done.stdout.rstrip().endswith(render_summary(summary)), done.stdout
    started = [json.loads((sweep / job / "startup.json").read_text()) for job in ("0", "1")]
    first_ends = min(stamps["loop_ended"] for stamps in started)
    assert all(stamps["loop_started"] < first_ends for stamps in started), "the points ran at the same time"
