"""Atomic checkpoints: run_dir/checkpoints/step_N/{state.pt, meta.json}, written to a staging folder and renamed
(core/atomic_folder.py).

A checkpoint holds everything a resumed run needs to continue as if it had never stopped: the trainer's state
(adapter, optimizer, RNG), the next step and the data cursor. A run killed at any moment leaves either the old
latest checkpoint or the new one, never a partial one (the rename is the commit).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from miles_runner.core.atomic_folder import replace_folder

STATE = "state.pt"
META = "meta.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(
    run_dir: Path, step: int, trainer_state: dict[str, Any], meta: dict[str, Any], *, keep_last: int = 2
) -> Path:
    """`step` is the number of completed steps; the resumed run starts at that step index."""
    import torch

    def write(folder: Path) -> None:
        torch.save(trainer_state, folder / STATE)
        (folder / META).write_text(json.dumps({"step": step, **meta}))

    root = checkpoint_dir(run_dir)
    final = replace_folder(root / f"step_{step}", write)  # a re-save of the same step (after a resume) replaces it
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
