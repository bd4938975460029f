"""wandb, offline by default: project, run name and tags from the plan's logger section."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from miles_runner.config.schema import LoggerConfig


class WandbLogger:
    """A thin wrapper: no-op when disabled, so callers never branch on it."""

    def __init__(self, cfg: LoggerConfig, run_dir: Path, *, run_name: str, config: dict[str, Any]):
        self.run = None
        if cfg.wandb_mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=cfg.project,
            name=cfg.run_name or run_name,
            tags=list(cfg.tags),
            mode=cfg.wandb_mode,
            dir=str(run_dir),
            config=config,
            reinit="finish_previous",
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
