"""A sweep ends with its summary (console, sweep_summary.md/.json): every job with its overrides, final reward,
wall time and status; a failed job does not stop or hide the others; each job's console is a single run's."""

import json
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from miles_runner.cli.sweep_summary import (
    PENDING,
    RUNNING,
    SUMMARY_JSON,
    SUMMARY_MD,
    distinguishing_overrides,
    duration,
    render_summary,
    summarize_sweep,
)
from miles_runner.tracking.job_result import COMPLETED, FAILED, INTERRUPTED, read_records, write_result
from tests.drivers import run_short_sweep, runner_command
from tests.run_files import files_named

pytestmark = pytest.mark.integration

DRIVER_FRAME = "miles_runner/loops/run.py"  # in every traceback of a failed run: it belongs in driver.log


def make_job(
    sweep: Path,
    folder: str,
    num: int,
    argv: list[str],
    records: list[dict] = (),
    *,
    status: str | None = None,
    started: bool = False,
) -> Path:
    """A job folder as a sweep leaves it: the run record, Hydra's job number, metrics and (once ended) result."""
    run_dir = sweep / folder
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"job": {"num": num, "id": str(num)}}}))
    (run_dir / "plan.yaml").write_text("name: custom\n")
    (run_dir / "provenance.json").write_text(json.dumps({"argv": argv}))
    if records:
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if started or status:
        (run_dir / "logs").mkdir()
        (run_dir / "logs" / "driver.log").write_text("")
    if status:
        write_result(run_dir, status, 0 if status == COMPLETED else 1, 75.0)
    return run_dir


def test_the_summary_lists_every_job_in_order_with_status_reward_and_wall_time(tmp_path):
    common = ["+recipe=tiny_lora_agentic", "algorithm.num_steps=2"]
    make_job(tmp_path, "10", 10, [*common, "optimizer.lr=0.1"], [{"step": 0, "reward/mean": 0.25}], status=FAILED)
    make_job(
        tmp_path,
        "2",
        2,
        [*common, "optimizer.lr=0.01"],
        [{"step": 0, "reward/mean": 0.25}, {"step": 1, "reward/mean": 0.75}],
        status=COMPLETED,
    )
    make_job(tmp_path, "3", 3, [*common, "optimizer.lr=0.001"], started=True)
    make_job(tmp_path, "4", 4, [*common, "optimizer.lr=0.0001"])

    summary = summarize_sweep(tmp_path)

    assert [(j.number, j.status) for j in summary.jobs] == [(2, COMPLETED), (3, RUNNING), (4, PENDING), (10, FAILED)]
    done = summary.jobs[0]
    assert (done.final_reward, done.steps, done.wall_s, done.exit_code) == (0.75, 2, 75.0, 0)
    assert summary.jobs[3].steps == 1 and summary.jobs[3].exit_code == 1
    assert summary.failed == [summary.jobs[3]] and summary.exit_code == 1
    assert json.loads((tmp_path / SUMMARY_JSON).read_text()) == json.loads(json.dumps(asdict(summary)))
    markdown = (tmp_path / SUMMARY_MD).read_text()
    assert "| #2 | optimizer.lr=0.01 | 0.75 | 1m15s | completed |" in markdown
    assert "| #10 | optimizer.lr=0.1 | 0.25 | 1m15s | failed |" in markdown
    console = render_summary(summary).splitlines()
    assert console[0] == "sweep summary: 4 jobs: 1 completed, 1 running, 1 pending, 1 failed"
    assert console[1].split() == ["job", "overrides", "final", "reward", "wall", "time", "status"]
    assert console[2].split() == ["#2", "optimizer.lr=0.01", "0.75", "1m15s", "completed"]
    assert console[4].split() == ["#4", "optimizer.lr=0.0001", "-", "-", "pending"]


def test_jobs_not_yet_ended_do_not_fail_the_sweep(tmp_path):
    make_job(tmp_path, "0", 0, ["a=1"], [{"step": 0, "reward/mean": 1.0}], status=COMPLETED)
    make_job(tmp_path, "1", 1, ["a=2"], started=True)
    summary = summarize_sweep(tmp_path, write=False)
    assert summary.exit_code == 0 and summary.failed == []
    assert not (tmp_path / SUMMARY_MD).exists()


def test_an_interrupted_job_fails_the_sweep(tmp_path):
    make_job(tmp_path, "0", 0, ["a=1"], [{"step": 0, "reward/mean": 1.0}], status=INTERRUPTED)
    assert summarize_sweep(tmp_path).exit_code == 1


def test_a_multi_lora_reward_is_the_mean_of_each_adapters_last_reward(tmp_path):
    # each multi-LoRA record covers the adapters that trained at that step (records.py)
    records = [
        {"step": 0, "reward/mean": 0.5, "count/reward/mean": 0.5, "letters/reward/mean": 0.5},
        {"step": 1, "reward/mean": 0.5, "retry/reward/mean": 0.25, "count/reward/mean": 1.0},
        {"step": 2, "reward/mean": 0.0, "letters/reward/mean": 0.0},
    ]
    run_dir = make_job(tmp_path, "0", 0, ["+recipe=tiny_multi_lora"], records, status=COMPLETED)
    [job] = summarize_sweep(tmp_path).jobs
    assert job.adapter_rewards == {"count": 1.0, "letters": 0.0, "retry": 0.25}
    assert job.final_reward == pytest.approx(1.25 / 3) and job.steps == 3
    assert json.loads((run_dir / "result.json").read_text())["adapter_rewards"] == job.adapter_rewards
    assert "0.4167 (count 1, letters 0, retry 0.25)" in render_summary(summarize_sweep(tmp_path))


def test_a_metrics_line_cut_by_a_crash_is_not_the_last_step(tmp_path):
    run_dir = make_job(tmp_path, "0", 0, ["a=1"], [{"step": 0, "reward/mean": 0.5}])
    with (run_dir / "metrics.jsonl").open("a") as out:
        out.write('{"step": 1, "reward/me')
    result = write_result(run_dir, FAILED, 1, 1.0)
    assert (result.steps, result.final_reward) == (1, 0.5)


def test_the_table_shows_what_differs_between_jobs():
    assert distinguishing_overrides([["a=1", "b=1"], ["a=1", "b=2"]]) == [["b=1"], ["b=2"]]
    assert distinguishing_overrides([["a=1", "b=1"]]) == [["a=1", "b=1"]]  # one job: all of them
    assert distinguishing_overrides([["a=1"], ["a=1"]]) == [["a=1"], ["a=1"]]
    assert [duration(s) for s in (None, 4.25, 75, 3725)] == ["-", "4.2s", "1m15s", "1h02m"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sweep_runs_every_job_when_one_fails_and_ends_with_the_summary(tmp_path):
    """Job 0's model folder has no model, which only the engine finds out when it starts; job 1 trains."""
    empty_model = tmp_path / "empty-model"
    empty_model.mkdir()
    done, console, sweep = run_short_sweep(tmp_path, "session=off", f"model.path={empty_model},tiny:tiny-moe:format")
    assert done.returncode == 1, console
    failed, completed = sweep / "0", sweep / "1"

    # both jobs ran; the failed one printed its report as a single run does, the other its progress
    assert console.count("miles-run: the run failed") == 1 and f"run folder: {failed}" in console, console
    assert "step 2/2" in done.stdout and f"run folder: {completed}" in done.stdout
    assert "HTTP Request" not in console and DRIVER_FRAME not in console, "per-request and traceback lines"
    assert "Traceback" in (failed / "logs" / "driver.log").read_text()
    assert not list(sweep.glob("*/*.log")), "Hydra's <job>.log would duplicate logs/driver.log"

    summary = summarize_sweep(sweep, write=False)
    assert [(j.number, j.status) for j in summary.jobs] == [(0, FAILED), (1, COMPLETED)]
    last_reward = read_records(completed)[-1]["reward/mean"]
    assert summary.jobs[1].final_reward == last_reward and summary.jobs[1].steps == 2
    assert done.stdout.rstrip().endswith(render_summary(summary)), done.stdout
    assert json.loads((sweep / SUMMARY_JSON).read_text()) == json.loads(json.dumps(asdict(summary)))
    assert f"| #1 | model.path=tiny\\:tiny-moe\\:format | {last_reward:.4g} |" in (sweep / SUMMARY_MD).read_text()


def test_a_plan_only_sweep_prints_no_summary(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "miles_runner.cli.main",
            "--multirun",
            "--plan",
            "+recipe=tiny_lora_agentic",
            "session=v1,v2",
            f"run.output_root={tmp_path / 'out'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "sweep summary" not in done.stdout
    assert len(list((tmp_path / "out").rglob("plan.yaml"))) == 2 and not list(tmp_path.rglob(SUMMARY_MD))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ctrl_c_stops_the_whole_sweep_and_still_summarises_it(tmp_path):
    proc = subprocess.Popen(
        runner_command(
            "miles_runner.cli.main",
            "--multirun",
            "session=off",
            "algorithm.num_steps=50",
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=4",
            f"run.output_root={tmp_path / 'out'}",
            "logger=none",
            "optimizer.lr=0.1,0.2",
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while not any(read_records(m.parent) for m in files_named(tmp_path / "out", "metrics.jsonl")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stdout + stderr
    [sweep] = {p.parent.parent for p in (tmp_path / "out" / "multirun").rglob("plan.yaml")}
    assert not (sweep / "1").exists(), "Ctrl-C stops the sweep, not only the job running"
    [job] = summarize_sweep(sweep, write=False).jobs
    assert (job.number, job.status, job.exit_code) == (0, INTERRUPTED, 130)
    assert stdout.rstrip().endswith(render_summary(summarize_sweep(sweep, write=False)))
