"""The Slurm launcher against a real single-node Slurm (tests/slurm/conftest.py): a two-job sweep of the tiny
recipe, two jobs sharing the node, a requeued job that resumes from its last checkpoint, and the wait for a Ray node
that never joins.

The commands are the README's ("Running on a Slurm cluster"). Most jobs ask for both cores of the 2-core node
(cpus_per_task=2), so Slurm runs a sweep's jobs one after the other; with one core each, two run side by side. Each
job's servers choose their ports on the node when it starts.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_runner.core.faults import EXPECT_MISSING_NODE
from miles_runner.loops.single_adapter import STARTUP_FILE
from miles_runner.plan.record import read_ports
from miles_runner.slurm.jobs import job_states
from miles_runner.slurm.submit import read_manifest
from miles_runner.tracking.job_result import COMPLETED, FAILED, read_result

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

MILES_RUN = str(Path(sys.executable).parent / "miles-run")
TINY = ["+recipe=tiny_lora_agentic", "rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "logger=none"]
LAUNCHER = ["hydra/launcher=miles_slurm", "hydra.launcher.cpus_per_task=2", "hydra.launcher.mem=4G"]
FIGURES = Path(os.environ.get("MILES_SLURM_FIGURES", "/tmp/miles_slurm_figures.json"))


def miles_run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [MILES_RUN, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, f"miles-run {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def steps_of(job_dir: Path) -> list[int]:
    path = job_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_end(sweep_dir: Path, timeout_s: float = 400):
    manifest = read_manifest(sweep_dir)
    return wait_until(
        lambda: (s := job_states(manifest)) and all(x.ended for x in s) and s,
        timeout_s,
        f"the jobs of {sweep_dir} to end",
        poll_s=1,
    )


def scontrol_show(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout


def record_figure(name: str, value) -> None:
    figures = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    figures[name] = value
    FIGURES.write_text(json.dumps(figures, indent=1))


def leftover_processes(job_id: str) -> list[str]:
    """Processes still carrying the job's SLURM_JOB_ID in their environment (the job's, whatever attempt)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def test_the_local_node_offers_every_core_whatever_openmp_is_told(slurm_cluster):
    # The suite runs with OMP_NUM_THREADS=1 (tests/conftest.py), which `nproc` honours: a node configured from it
    # had 1 CPU, and every job of cpus_per_task=2 stayed pending (PartitionConfig) until its test timed out.
    assert os.environ.get("OMP_NUM_THREADS") == "1"
    node = subprocess.run(["scontrol", "show", "node"], capture_output=True, text=True, check=True).stdout
    assert f"CPUTot={len(os.sched_getaffinity(0))} " in node, node


def test_a_two_job_sweep_completes_in_separate_folders_and_status_reports_them(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = subprocess.Popen(
        [
            MILES_RUN,
            "-m",
            *TINY,
            *LAUNCHER,
            "algorithm.num_steps=3",
            "run.seed=1,2",
            "hydra.launcher.wait=true",
            "hydra.launcher.poll_interval_s=1",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    first_step_at: dict[str, float] = {}
    while proc.poll() is None:  # submit-to-first-step, per job (a measurement, not an assertion)
        for job in ("0", "1"):
            if job not in first_step_at and steps_of(sweep_dir / job):
                first_step_at[job] = time.time()
        time.sleep(0.5)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-4000:]
    manifest = read_manifest(sweep_dir)
    assert len(manifest.jobs) == 2 and {j.job_id for j in manifest.jobs} == {
        f"{manifest.array_job_id}_{i}" for i in (0, 1)
    }
    folders = [Path(j.job_dir) for j in manifest.jobs]
    assert len(set(folders)) == 2
    for folder in folders:
        assert read_result(folder).status == COMPLETED and steps_of(folder) == [0, 1, 2]
    status = miles_run("--status", str(sweep_dir)).stdout
    for job in manifest.jobs:
        assert any(job.job_id in line and "COMPLETED" in line and job.job_dir in line for line in status.splitlines())
    assert "sweep summary: 2 jobs: 2 completed" in status
    waits = [first_step_at[j] - manifest.submitted_at for j in first_step_at]
    record_figure("sweep_submit_to_first_step_s", {"per_job": waits, "median": statistics.median(waits)})


def test_two_jobs_sharing_the_node_run_side_by_side_each_on_ports_of_its_own(slurm_cluster, tmp_path):
    # One core each: Slurm runs both jobs at once on the 2-core node, as two users' jobs share a GPU node.
    sweep_dir = tmp_path / "shared"
    shared_node = ["hydra/launcher=miles_slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem=4G"]
    wait = ["hydra.launcher.wait=true", "hydra.launcher.poll_interval_s=1", f"hydra.sweep.dir={sweep_dir}"]
    miles_run("-m", *TINY, *shared_node, "algorithm.num_steps=3", "run.seed=1,2", *wait, timeout=560)
    folders = [Path(job.job_dir) for job in read_manifest(sweep_dir).jobs]
    for folder in folders:
        assert read_result(folder).status == COMPLETED and steps_of(folder) == [0, 1, 2]
    first, second = (read_ports(folder) for folder in folders)
    assert first and second and not set(first.values()) & set(second.values())
    spans = [json.loads((folder / STARTUP_FILE).read_text()) for folder in folders]
    assert all(a["loop_started"] < b["loop_ended"] for a, b in (spans, spans[::-1])), "the jobs ran one after the other"


def test_a_requeued_job_resumes_from_its_last_checkpoint(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "requeued"
    steps = 12
    miles_run(
        *TINY,
        *LAUNCHER,
        f"algorithm.num_steps={steps}",
        "checkpoint.interval=1",
        f"hydra.sweep.dir={sweep_dir}",
    )  # no --multirun: one job, submitted, and miles-run returns
    [job] = read_manifest(sweep_dir).jobs
    job_dir = Path(job.job_dir)
    wait_until(lambda: len(steps_of(job_dir)) >= 3, 300, "three steps of the first attempt")
    requeued_after = len(steps_of(job_dir))
    subprocess.run(["scontrol", "requeue", job.job_id], check=True)
    wait_until(lambda: "JobState=PENDING" in scontrol_show(job.job_id), 120, "the requeued job to be pending")
    # Slurm holds a requeued job back for 120 s (EligibleTime); release it now, as an admin may.
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], check=True)
    [state] = wait_for_end(sweep_dir)
    assert state.state == "COMPLETED", (job_dir / "slurm.out").read_text()[-3000:]
    assert steps_of(job_dir) == list(range(steps)), "every step exactly once"
    result = read_result(job_dir)
    assert (result.status, result.steps) == (COMPLETED, steps)
    log = (job_dir / "slurm.out").read_text()
    assert "=== miles: attempt 1 of job" in log and "=== miles: attempt 2 of job" in log
    assert "resuming from its checkpoint after" in log
    assert "miles: SIGTERM (requeue, preemption or cancel)" in log  # the job script's trap ran
    # The driver tore its servers down: stopped by its SIGTERM, or failed first by Ray's node going (the signal
    # reaches the job's steps in no set order).
    assert "every process it started was stopped" in log.split("=== miles: attempt 2")[0]
    raw_id = scontrol_show(job.job_id).split("JobId=")[1].split()[0]  # the task's own id, in its environment
    assert leftover_processes(raw_id) == [], "a process of the job outlived it"
    resumed_at = int(log.split("resuming from its checkpoint after ")[1].split()[0])
    record_figure(
        "requeue",
        {
            "steps": steps,
            "requeued_after_steps": requeued_after,
            "resumed_from": resumed_at,
            "metrics_steps": steps_of(job_dir),
        },
    )


def test_a_node_that_never_joins_fails_the_job_naming_it(slurm_cluster, tmp_path):
    sweep_dir = tmp_path / "missing_node"
    miles_run(
        *TINY,
        *LAUNCHER,
        "algorithm.num_steps=1",
        "hydra.launcher.nodes_timeout_s=10",
        f"hydra.sweep.dir={sweep_dir}",
        env={EXPECT_MISSING_NODE: "1"},
    )
    [state] = wait_for_end(sweep_dir, timeout_s=200)
    job_dir = Path(state.job.job_dir)
    log = (job_dir / "slurm.out").read_text()
    assert state.state == "FAILED", log[-3000:]
    assert "1 of the job's 2 Ray nodes did not join within 10 s" in log
    assert "missing: plan node 1 (miles_node_1) not in the allocation (1 node(s)" in log
    assert read_result(job_dir).status == FAILED and steps_of(job_dir) == []
