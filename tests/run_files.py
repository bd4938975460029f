"""Finding a run's files while the run is still writing them.

`Path.rglob` fails with FileNotFoundError when a folder it listed is gone before it looks inside: a live run's
checkpoint is written to `checkpoints/.step_N.staging` and renamed into place, so a search of its folder can meet one.
os.walk passes over a folder that vanished (its error goes to `onerror`, unset), which a poll of a live run wants.
"""

from __future__ import annotations

import os
from pathlib import Path


def files_named(root: Path, name: str) -> list[Path]:
    """Every file called `name` under `root`, in sorted order; folders that vanish meanwhile are skipped."""
    return sorted(Path(folder) / name for folder, _, files in os.walk(root) if name in files)
