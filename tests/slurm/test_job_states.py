"""Job states when the Slurm controller does not answer a poll (a busy or restarting slurmctld, as on a loaded
machine): the state is UNREACHABLE, which is not an end, rather than the job's end. The squeue and scontrol here are
fakes that inject that fault, and Slurm's answer for a job it has forgotten."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles_runner.slurm.jobs import UNREACHABLE, job_states
from miles_runner.slurm.submit import Manifest, ManifestJob
from miles_runner.tracking.job_result import COMPLETED, write_result

UNREACHABLE_ANSWER = "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"
FORGOTTEN_ANSWER = "slurm_load_jobs error: Invalid job id specified"


def fake_slurm(bin_dir: Path, answer: str) -> None:
    """squeue and scontrol that fail with `answer` on stderr, as Slurm's own tools do."""
    bin_dir.mkdir(exist_ok=True)
    for tool in ("squeue", "scontrol"):
        path = bin_dir / tool
        path.write_text(f"#!/bin/sh\necho '{answer}' >&2\nexit 1\n")
        path.chmod(0o755)


@pytest.fixture()
def manifest(tmp_path) -> Manifest:
    job_dir = tmp_path / "0"
    job_dir.mkdir()
    return Manifest("42", 0.0, "job.sh", [ManifestJob(0, "42_0", str(job_dir), [])])


def test_a_poll_the_controller_does_not_answer_is_not_the_jobs_end(tmp_path, monkeypatch, manifest):
    fake_slurm(tmp_path / "bin", UNREACHABLE_ANSWER)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    [state] = job_states(manifest)
    assert state.state == UNREACHABLE and not state.ended


def test_a_job_slurm_has_forgotten_ends_as_its_run_recorded(tmp_path, monkeypatch, manifest):
    fake_slurm(tmp_path / "bin", FORGOTTEN_ANSWER)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    [unrecorded] = job_states(manifest)
    assert unrecorded.state == "UNKNOWN" and unrecorded.ended
    write_result(Path(manifest.jobs[0].job_dir), COMPLETED, 0, 3.0)
    [recorded] = job_states(manifest)
    assert recorded.state == COMPLETED.upper() and recorded.ended
