"""`python -m miles_runner.cli.recorded_run RUN_DIR`: run the plan recorded in RUN_DIR/plan.yaml, going on from
the folder's last checkpoint when it has one. The Slurm job script's run: a requeued or preempted job comes back
to the same folder and resumes, so no step is lost or done twice.

SIGTERM (Slurm's requeue, preemption and scancel) stops the run as Ctrl-C does: every server it started is
stopped before the process exits, and result.json says interrupted.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from miles_runner.cli.pipeline import execute
from miles_runner.loops.checkpoint import completed_steps
from miles_runner.plan.record import read_plan
from miles_runner.plan.summary import summarize


def stop_on_sigterm() -> None:
    """Turn the first SIGTERM into KeyboardInterrupt, so the run's own Ctrl-C teardown stops its servers. Slurm
    signals every process of the job and the job script forwards its own SIGTERM too: later ones are ignored, so
    they cannot interrupt the teardown itself. Ray's fatal-signal handler is off for this driver: it would
    answer SIGTERM with a stack dump and abort() halfway through the teardown."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m miles_runner.cli.recorded_run RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    plan = read_plan(run_dir / "plan.yaml")
    done = completed_steps(run_dir)
    print(summarize(plan, str(run_dir / "plan.yaml")))
    if done:
        print(f"miles: resuming from its checkpoint after {max(done)} completed steps", flush=True)
    stop_on_sigterm()
    return execute(plan, run_dir, resume=bool(done))


if __name__ == "__main__":
    sys.exit(main())
