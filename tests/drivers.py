"""The command line of a runner entry point that a test starts as its own process (a run's driver, a sweep).

Through `python -m miles_runner.procs.warm_exec` when this test process has a warm start server (tests/conftest.py):
the same module, argv, environment, pipes, signals and exit code, forked from a process that has imported torch,
transformers and the rest (a cold driver's start is mostly those imports, and the suite starts many). The console script
itself starts as a user starts it in tests/cli/test_miles_run.py and tests/packaging.
"""

import os
import sys

from miles_runner.procs.warm import WARM_START_ENV, WARM_START_OFF


def runner_command(module: str, *args: str) -> list[str]:
    """`python -m module args...`, started warm where it can be."""
    command = [sys.executable, "-m", module, *args]
    if os.environ.get(WARM_START_ENV, WARM_START_OFF) in ("", WARM_START_OFF):
        return command
    return [sys.executable, "-m", "miles_runner.procs.warm_exec", *command]
