"""The miles side: `miles-run` (the installed CLI, a subprocess) on the work's overrides, timed from outside.

Step wall times come from when its "step k/N" lines arrive (``logger.progress=plain`` prints one per step, flushed);
the breakdown and the reward from the run's metrics.jsonl (rollout/seconds, train/seconds, sync/seconds plus the
probe's verify/seconds, reward/mean). Tracking is off (``logger=none``, no plots) as TRL's ``report_to="none"``,
and periodic checkpoints too (TRL: ``save_strategy="no"``); the final adapter and checkpoint are still written.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.peers.records import SideRun, StepRecord, step_walls
from bench.peers.work import Row, Work, miles_overrides
from miles_runner.procs.ports import free_port, free_port_block
from miles_runner.tracking.metrics import MetricsFile

STEP_LINE = re.compile(r"^step (\d+)/(\d+) ")
# Not part of the work: where the run goes and what it logs.
QUIET = ["logger=none", "logger.progress=plain", "logger.plots=false", "checkpoint.interval=0"]


def miles_cli() -> str:
    """The miles-run console script of the running (main) venv."""
    return str(Path(sys.executable).with_name("miles-run"))


def miles_command(work: Work, row: Row, run_dir: Path) -> list[str]:
    ports = [f"engine.base_port={free_port_block(2)}", f"session.port={free_port()}"]
    return [miles_cli(), *miles_overrides(work, row), *QUIET, *ports, f"hydra.run.dir={run_dir}"]


def run_miles(work: Work, row: Row, run_dir: Path, timeout_s: float = 900) -> SideRun:
    command = miles_command(work, row, run_dir)
    started = time.perf_counter()
    ends, lines = [], []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        watchdog = threading.Timer(timeout_s, proc.kill)  # a hung run ends the bench instead of stalling it
        watchdog.start()
        try:
            for line in proc.stdout:
                if STEP_LINE.match(line):
                    ends.append(time.perf_counter())
                lines.append(line)
            code = proc.wait()
        finally:
            watchdog.cancel()
    process_s = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"miles-run exited {code}: {' '.join(command)}\n{''.join(lines[-30:])}")
    records = MetricsFile(run_dir / "metrics.jsonl").read()
    if len(records) != len(ends):
        raise RuntimeError(f"{len(ends)} step lines but {len(records)} metrics records in {run_dir}")
    steps = [step_record(r, wall) for r, wall in zip(records, step_walls(ends), strict=True)]
    return SideRun("miles", row.name, process_s, steps, command)


def step_record(metrics: dict, wall_s: float | None) -> StepRecord:
    sync_s = (metrics.get("sync/seconds") or 0.0) + (metrics.get("verify/seconds") or 0.0)
    return StepRecord(
        metrics["step"], wall_s, metrics["reward/mean"], metrics["rollout/seconds"], metrics["train/seconds"], sync_s
    )
