"""A real single-node Slurm for the tests marked `slurm`: scripts/slurm_local.sh starts slurmctld and slurmd on
127.0.0.1 for the module that uses it (installing slurm-wlm with apt when it is missing and we are root) and stops
them when that module ends. Where Slurm cannot be installed or started, those tests are skipped with the reason."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "scripts" / "slurm_local.sh"
EXIT_CANNOT_INSTALL = 3  # slurm_local.sh: not installed, and installing needs root


# Module scope: one file uses it, and its stop (seconds of waiting on the daemons) then overlaps the other workers'
# tests instead of adding to the last worker's teardown at the end of `make test`.
@pytest.fixture(scope="module")
def slurm_cluster():
    """The running local cluster (its partition is `debug`); stopped when the module that uses it ends."""
    started = subprocess.run(["bash", str(SLURM_LOCAL), "up"], capture_output=True, text=True, timeout=600)
    if started.returncode == EXIT_CANNOT_INSTALL or (started.returncode and not shutil.which("slurmctld")):
        pytest.skip(f"Slurm cannot be installed here: {started.stderr.strip()[-500:]}")
    assert started.returncode == 0, f"slurm_local.sh up failed:\n{started.stdout}\n{started.stderr}"
    yield
    queued = subprocess.run(["squeue", "-h", "-o", "%A %j"], capture_output=True, text=True).stdout.splitlines()
    for job in [line.split()[0] for line in queued if line.split()[1:2] and line.split()[1].startswith("miles-")]:
        subprocess.run(["scancel", job], check=False)  # what a failed test left queued
    subprocess.run(["bash", str(SLURM_LOCAL), "down"], check=False, timeout=120)
