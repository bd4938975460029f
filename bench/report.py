"""Benchmarks write their figures here: bench/results/<name>.json plus their own section of bench/REPORT.md."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results"
REPORT = BENCH_DIR / "REPORT.md"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write_result(name: str, figures: dict[str, Any], summary: list[str]) -> Path:
    """Save the figures as JSON and replace this benchmark's section in REPORT.md (others are kept)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().astimezone().isoformat(timespec="seconds")
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"name": name, "measured": stamp, "machine": machine(), **figures}, indent=2))
    section = "\n".join(
        [
            f"<!-- {name} -->",
            f"## {name}",
            f"_measured {stamp} on {machine()['cpus']} cores_",
            "",
            *summary,
            f"<!-- /{name} -->",
        ]
    )
    text = REPORT.read_text() if REPORT.exists() else "# Benchmark report\n\nFigures written by `make bench`.\n"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section + "\n"
    REPORT.write_text(text)
    return path
