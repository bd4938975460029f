"""Submitting a sweep as ONE job array, and its manifest (sweep folder/slurm_manifest.json): the array's job id,
and per array task its job id, job folder and overrides. The status command and wait=true read it back."""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.model import Plan
from miles_runner.slurm.script import JOB_SCRIPT, header_options, job_name, render_array_script, render_job_script
from miles_runner.slurm.settings import SlurmSettings

MANIFEST = "slurm_manifest.json"
ARRAY_SCRIPT = "sweep.sbatch"


@dataclass(frozen=True)
class ManifestJob:
    task: int  # the array task
    job_id: str  # ARRAY_TASK, as squeue and scontrol name it
    job_dir: str
    overrides: list[str]


@dataclass(frozen=True)
class Manifest:
    array_job_id: str
    submitted_at: float  # unix time
    script: str
    jobs: list[ManifestJob]


@dataclass(frozen=True)
class PlannedJob:
    job_dir: Path
    overrides: list[str]
    plan: Plan


def write_job_scripts(jobs: list[PlannedJob], settings: SlurmSettings, python: str) -> None:
    for job in jobs:
        (job.job_dir / JOB_SCRIPT).write_text(render_job_script(job.plan, settings, job.job_dir.resolve(), python))


def array_options(jobs: list[PlannedJob], settings: SlurmSettings) -> list[str]:
    """The shared #SBATCH options; a job array has one shape, so the sweep's plans must agree on it."""
    shapes = {tuple(header_options(job.plan, settings)): job for job in jobs}
    if len(shapes) > 1:
        raise PlanError(
            [
                Problem(
                    "slurm-sweep-shapes-differ",
                    [(" ".join(job.overrides), "sweep point") for job in shapes.values()],
                    "A sweep goes in as one Slurm job array, whose jobs all get the same allocation; "
                    "these points' plans ask for different ones (cluster.nodes or cluster.gpus_per_node).",
                    "sweep over one cluster shape per --multirun",
                )
            ]
        )
    return list(next(iter(shapes)))


def submit_array(sweep_dir: Path, jobs: list[PlannedJob], settings: SlurmSettings, python: str) -> Manifest:
    """Write every job's script and the array script, `sbatch --parsable` it, write the manifest."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    write_job_scripts(jobs, settings, python)
    script = sweep_dir / ARRAY_SCRIPT
    script.write_text(
        render_array_script(
            array_options(jobs, settings),
            job_name(jobs[0].plan, settings),
            sweep_dir.resolve(),
            [job.job_dir.resolve() for job in jobs],
        )
    )
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if submitted.returncode != 0:
        raise RuntimeError(f"sbatch refused {script}: {submitted.stderr.strip() or submitted.stdout.strip()}")
    array_id = submitted.stdout.strip().split(";")[0]  # "ID" or "ID;CLUSTER"
    manifest = Manifest(
        array_id,
        time.time(),
        str(script.resolve()),
        [
            ManifestJob(i, f"{array_id}_{i}", str(job.job_dir.resolve()), list(job.overrides))
            for i, job in enumerate(jobs)
        ],
    )
    write_manifest(sweep_dir, manifest)
    return manifest


def write_manifest(sweep_dir: Path, manifest: Manifest) -> None:
    path = sweep_dir / MANIFEST
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(asdict(manifest), indent=1))
    staging.replace(path)


def read_manifest(sweep_dir: Path) -> Manifest:
    path = Path(sweep_dir) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{sweep_dir} holds no {MANIFEST}: it is not a sweep submitted to Slurm")
    data = json.loads(path.read_text())
    return Manifest(
        data["array_job_id"], data["submitted_at"], data["script"], [ManifestJob(**job) for job in data["jobs"]]
    )
