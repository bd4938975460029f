"""Atomic checkpoints: run_dir/checkpoints/step_N/{state.pt, meta.json}, written to a temp folder and renamed.

A checkpoint holds everything a resumed run needs to continue as if it had never stopped: the trainer's state
(adapter, optimizer, RNG), the next step and the data cursor. A run killed at any moment leaves either the old
latest checkpoint or the new one, never a partial one (the rename is the commit).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

STATE = "state.pt"
META = "meta.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path, step: int, trainer_state: dict[str, Any], meta: dict[str, Any], *, keep_last: int = 2
) -> Path:
    """`step` is the number of completed steps; the resumed run starts at that step index."""
    import torch

    root = checkpoint_dir(run_dir)
    final = root / f"step_{step}"
    staging = root / f".tmp_step_{step}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.save(trainer_state, staging / STATE)
    (staging / META).write_text(json.dumps({"step": step, **meta}))
    _fsync_dir(staging)
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(root)
    prune(root, keep_last)
    return final


def completed_steps(run_dir: Path) -> list[int]:
    root = checkpoint_dir(run_dir)
    if not root.exists():
        return []
    return sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*") if (p / META).exists())


def load_latest(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(trainer_state, meta) of the newest complete checkpoint, or None."""
    import torch

    steps = completed_steps(run_dir)
    if not steps:
        return None
    folder = checkpoint_dir(run_dir) / f"step_{steps[-1]}"
    meta = json.loads((folder / META).read_text())
    return torch.load(folder / STATE, weights_only=True), meta


def prune(root: Path, keep_last: int) -> None:
    steps = sorted(int(p.name.removeprefix("step_")) for p in root.glob("step_*"))
    for step in steps[: max(len(steps) - keep_last, 0)]:
        shutil.rmtree(root / f"step_{step}", ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
