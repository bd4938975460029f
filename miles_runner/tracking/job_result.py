"""What a finished run leaves for whoever summarises it: RUN_DIR/result.json.

Written by `execute` whatever ended the run (completed, failed, stopped by a check, interrupted), atomically,
so a sweep summary, `miles-run --status` and the Slurm launcher's `wait=true` read one file per job instead of
parsing logs. The final reward is the last metrics.jsonl record's `reward/mean`; a multi-LoRA run's records
each cover the adapters that trained at that step, so there it is the mean of every adapter's last
`<name>/reward/mean` (kept per adapter in `adapter_rewards`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULT_FILE = "result.json"
METRICS_FILE = "metrics.jsonl"
REWARD_KEY = "reward/mean"
ADAPTER_REWARD_SUFFIX = "/" + REWARD_KEY

COMPLETED, FAILED, STOPPED, INTERRUPTED = "completed", "failed", "stopped", "interrupted"


@dataclass(frozen=True)
class JobResult:
    status: str  # completed | failed | stopped | interrupted
    exit_code: int
    wall_s: float
    steps: int  # the steps metrics.jsonl records (its last step + 1; 0: none)
    final_reward: float | None
    ended_at: float  # seconds since the epoch
    adapter_rewards: dict[str, float] = field(default_factory=dict)  # multi-LoRA: each adapter's last reward


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The complete records of RUN_DIR/metrics.jsonl (a line cut by a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def adapter_rewards(records: list[dict[str, Any]]) -> dict[str, float]:
    """Each adapter's last `<name>/reward/mean` (empty for a single-adapter run)."""
    last: dict[str, float] = {}
    for record in records:
        for key, value in record.items():
            if key.endswith(ADAPTER_REWARD_SUFFIX) and isinstance(value, int | float):
                last[key.removesuffix(ADAPTER_REWARD_SUFFIX)] = float(value)
    return dict(sorted(last.items()))


def final_reward(records: list[dict[str, Any]], per_adapter: dict[str, float]) -> float | None:
    if per_adapter:
        return sum(per_adapter.values()) / len(per_adapter)
    value = records[-1].get(REWARD_KEY) if records else None
    return float(value) if isinstance(value, int | float) else None


def write_result(run_dir: Path, status: str, exit_code: int, wall_s: float) -> JobResult:
    records = read_records(run_dir)
    per_adapter = adapter_rewards(records)
    steps = int(records[-1].get("step", -1)) + 1 if records else 0
    result = JobResult(
        status, exit_code, round(wall_s, 3), steps, final_reward(records, per_adapter), time.time(), per_adapter
    )
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
