"""Job states without an accounting database: `squeue` while a job is queued or running, `scontrol show job`
for a while after it ended, then the job folder's result.json (how the run itself says it ended).

A query the controller does not answer (a busy or restarting slurmctld: "Unable to contact slurm controller",
"Socket timed out") says nothing about the job: its state is UNREACHABLE, which is not an end, and the next poll
asks again. Only Slurm's own "Invalid job id specified" means it has forgotten the job."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from miles_runner.slurm.submit import Manifest, ManifestJob
from miles_runner.tracking.job_result import JobResult, read_result

ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "UNREACHABLE",  # not Slurm's: the controller did not answer this poll (not an end)
}
UNREACHABLE = "UNREACHABLE"
FORGOTTEN = "Invalid job id specified"  # what squeue and scontrol answer for a job the controller no longer holds


class SlurmUnreachable(RuntimeError):
    """The controller did not answer a query."""


def slurm_query(argv: list[str]) -> str | None:
    """The query's output; None where Slurm says it does not know the job; SlurmUnreachable where it did not
    answer."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout
    if FORGOTTEN in done.stderr:
        return None
    raise SlurmUnreachable(f"{' '.join(argv[:2])}: {done.stderr.strip() or f'exit code {done.returncode}'}")


@dataclass(frozen=True)
class JobState:
    job: ManifestJob
    state: str  # Slurm's (PENDING, RUNNING, COMPLETED, ...) or, once Slurm forgot the job, the run's result
    nodes: str
    result: JobResult | None

    @property
    def ended(self) -> bool:
        return self.state not in ACTIVE


def queue_states(array_job_id: str) -> dict[str, tuple[str, str]]:
    """job id (ARRAY_TASK) -> (state, node list) for the array's tasks still in the queue."""
    out = slurm_query(["squeue", "-h", "-r", "-j", array_job_id, "-o", "%i|%T|%N"]) or ""
    states = {}
    for line in out.splitlines():
        job_id, state, nodes = [*line.split("|"), "", ""][:3]
        states[job_id.strip()] = (state.strip(), nodes.strip())
    return states


def scontrol_state(job_id: str) -> tuple[str, str] | None:
    out = slurm_query(["scontrol", "show", "job", job_id])
    if out is None:
        return None
    state = re.search(r"\bJobState=(\S+)", out)
    nodes = re.search(r"\bNodeList=(\S+)", out)
    if not state:
        return None
    return state.group(1), (nodes.group(1) if nodes and nodes.group(1) != "(null)" else "")


def job_states(manifest: Manifest) -> list[JobState]:
    try:
        queued = queue_states(manifest.array_job_id)
    except SlurmUnreachable:
        queued = None
    return [_job_state(job, queued) for job in manifest.jobs]


def _job_state(job: ManifestJob, queued: dict[str, tuple[str, str]] | None) -> JobState:
    """`queued`: squeue's answer (None: it did not answer); scontrol is asked for a job not in it."""
    result = read_result(Path(job.job_dir))
    try:
        found = (queued or {}).get(job.job_id) or scontrol_state(job.job_id)
    except SlurmUnreachable:
        found = (UNREACHABLE, "")
    if found is None:  # Slurm has forgotten it: the run's own record is all there is
        found = (result.status.upper() if result else "UNKNOWN", "")
    return JobState(job, found[0], found[1], result)


def wait_for_jobs(manifest: Manifest, poll_s: float) -> list[JobState]:
    """Block until every job of the sweep has ended; their final states."""
    while True:
        states = job_states(manifest)
        if all(s.ended for s in states):
            return states
        time.sleep(poll_s)


def format_states(states: list[JobState]) -> str:
    rows = [("job", "state", "nodes", "steps", "reward", "folder")]
    for s in states:
        result = s.result if s.ended else None
        rows.append(
            (
                s.job.job_id,
                s.state,
                s.nodes or "-",
                str(result.steps) if result else "-",
                f"{result.final_reward:.3f}" if result and result.final_reward is not None else "-",
                s.job.job_dir,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)
