"""A folder replaced whole: written into a staging folder beside it, then renamed into place, so that a reader (an
engine loading an adapter, a resumed run) finds the old folder or the new one, never half of one. Used by every
saver of adapters and checkpoints; a distributed saver keeps its own barrier."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def staging_folder(target: Path) -> Path:
    """Where `target` is written first: beside it, so the rename stays on one filesystem (atomic); hidden, so a
    search of the parent does not take it for a finished folder. Every rank of a collective save names the same."""
    return target.parent / f".{target.name}.staging"


def replace_folder(target: Path, write: Callable[[Path], object]) -> Path:
    """`write` fills a fresh staging folder, which then takes `target`'s place (a `target` already there, e.g. a
    re-save of the same step, is replaced whole). A `write` that fails leaves `target` as it was."""
    staging = staging_folder(target)
    shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
    staging.mkdir(parents=True)
    try:
        write(staging)
        _fsync(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync(target.parent)  # the rename itself reaches the disk
    return target


def _fsync(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
