"""The command line of a runner entry point that a test starts as its own process (a run's driver, a sweep).

Through `python -m miles_runner.procs.warm_exec` when this test process has a warm start server (tests/conftest.py):
the same module, argv, environment, pipes, signals and exit code, forked from a process that has imported torch,
transformers and the rest (a cold driver's start is mostly those imports, and the suite starts many). The console script
itself starts as a user starts it in tests/cli/test_miles_run.py and tests/packaging.
"""

import os
import subprocess
import sys
from pathlib import Path

from miles_runner.procs.warm import WARM_START_ENV, WARM_START_OFF


def runner_command(module: str, *args: str) -> list[str]:
    """`python -m module args...`, started warm where it can be."""
    command = [sys.executable, "-m", module, *args]
    if os.environ.get(WARM_START_ENV, WARM_START_OFF) in ("", WARM_START_OFF):
        return command
    return [sys.executable, "-m", "miles_runner.procs.warm_exec", *command]


# A sweep's points kept short: two steps of two prompts, two samples each, four tokens.
SHORT_RUN = (
    "algorithm.num_steps=2",
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.max_response_len=4",
    "logger=none",
)


def run_short_sweep(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, str, Path]:
    """`miles-run --multirun` of short points under tmp_path/out: the ended process, its whole console, and the
    sweep folder (the one that holds the points' plans)."""
    done = subprocess.run(
        runner_command(
            "miles_runner.cli.main", "--multirun", *SHORT_RUN, f"run.output_root={tmp_path / 'out'}", *overrides
        ),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
    )
    console = done.stdout + done.stderr
    sweeps = {p.parent.parent for p in (tmp_path / "out" / "multirun").rglob("plan.yaml")}
    assert len(sweeps) == 1, console
    return done, console, sweeps.pop()
