"""How a failed run ends: one clear error on the console, the traceback in the run's own log.

The console gets which component failed, why, the tail of that component's log and the run folder; the
traceback goes to RUN_DIR/logs/driver.log (and to the console too with `miles-run --debug`).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from pathlib import Path

from miles_runner.core.errors import ComponentFailure

DRIVER = "driver"  # the miles-run process itself: the loop, the trainer's rank 0 and the rollouts
DRIVER_LOG = "driver.log"
TAIL_LINES = 20
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextlib.contextmanager
def driver_log(run_dir: Path) -> Iterator[Path]:
    """While open, this process's log records (and, on failure, the traceback) go to RUN_DIR/logs/driver.log."""
    path = Path(run_dir) / "logs" / DRIVER_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    root, httpx_logger = logging.getLogger(), logging.getLogger("httpx")
    saved = root.level, httpx_logger.level
    root.addHandler(handler)
    root.setLevel(min(root.level or logging.INFO, logging.INFO))
    httpx_logger.setLevel(logging.WARNING)  # one INFO line per request would bury the rest
    try:
        yield path
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(saved[0])
        httpx_logger.setLevel(saved[1])


def failure_report(error: BaseException, run_dir: Path, driver_log: Path) -> str:
    """The console text of a failed run. Call before the traceback is logged: the driver's tail is what the
    driver logged up to the failure."""
    failure = component_failure(error)
    if failure is None:
        failure = ComponentFailure(
            DRIVER,
            f"{type(error).__name__}: {error}{where(error)}",
            log_path=str(driver_log),
            log_tail=tail(driver_log),
        )
    return "\n".join(
        [
            "miles-run: the run failed; every process it started was stopped.",
            failure.report(),
            f"run folder: {run_dir}",
            f"traceback:  {driver_log} (miles-run --debug also prints it here)",
        ]
    )


def log_traceback(error: BaseException) -> None:
    logging.getLogger("miles_runner.run").error("the run failed", exc_info=error)


def format_traceback(error: BaseException) -> str:
    return "".join(traceback.format_exception(error))


def component_failure(error: BaseException) -> ComponentFailure | None:
    """The ComponentFailure this error is or was raised from, if any."""
    return next((e for e in _chain(error) if isinstance(e, ComponentFailure)), None)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def where(error: BaseException) -> str:
    """` (at miles_runner/x.py:12 in fn)`: the innermost frame of the project's own code."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "miles_runner" in f.filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename[frame.filename.rindex('miles_runner') :]}:{frame.lineno} in {frame.name})"


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log yet)"
