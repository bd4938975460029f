"""What a finished run leaves for whoever summarises it: RUN_DIR/result.json.

Written by `execute` whatever ended the run (completed, failed, stopped by a check, interrupted), atomically,
so a sweep summary, `miles-run --status` and the Slurm launcher's `wait=true` read one file per job instead of
parsing logs. The final reward is the last metrics.jsonl record's `reward/mean` (multi-LoRA: the mean of the
adapters' `<name>/reward/mean`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
REWARD_KEY = "reward/mean"

COMPLETED, FAILED, STOPPED, INTERRUPTED = "completed", "failed", "stopped", "interrupted"


@dataclass(frozen=True)
class JobResult:
    status: str  # completed | failed | stopped | interrupted
    exit_code: int
    wall_s: float
    steps: int  # the last step metrics.jsonl records (0: none)
    final_reward: float | None
    ended_at: float  # seconds since the epoch


def last_record(run_dir: Path) -> dict[str, Any] | None:
    """The last complete line of RUN_DIR/metrics.jsonl (a line cut by a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None
    for line in reversed(path.read_text().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return None


def reward_of(record: dict[str, Any]) -> float | None:
    if isinstance(record.get(REWARD_KEY), int | float):
        return float(record[REWARD_KEY])
    per_adapter = [v for k, v in record.items() if k.endswith("/" + REWARD_KEY) and isinstance(v, int | float)]
    return sum(per_adapter) / len(per_adapter) if per_adapter else None


def write_result(run_dir: Path, status: str, exit_code: int, wall_s: float) -> JobResult:
    record = last_record(run_dir) or {}
    result = JobResult(status, exit_code, round(wall_s, 3), int(record.get("step", 0) or 0), reward_of(record),
                       time.time())
    path = Path(run_dir) / RESULT_FILE
    staging = path.with_suffix(".json.tmp")
    staging.write_text(json.dumps(asdict(result), indent=1))
    os.replace(staging, path)
    return result


def read_result(run_dir: Path) -> JobResult | None:
    """The run's result, or None while it has not ended (or never started)."""
    path = Path(run_dir) / RESULT_FILE
    if not path.exists():
        return None
    return JobResult(**json.loads(path.read_text()))
