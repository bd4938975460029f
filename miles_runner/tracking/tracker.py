"""The per-step tracker of a run: metrics.jsonl, wandb, the progress display, and plots at the end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_runner.plan.model import Plan, plan_to_dict
from miles_runner.tracking.metrics import MetricsFile
from miles_runner.tracking.plots import plot_metrics, summary_table
from miles_runner.tracking.progress import Progress
from miles_runner.tracking.wandb_logger import WandbLogger


class Tracker:
    """metrics.jsonl + wandb + progress for one run; records of steps a resume redoes are dropped first.

    With `logger.metrics_jsonl` false no metrics.jsonl is written: the records live in memory for the end-of-run
    plot and summary (a resumed run could not recover the earlier ones, so the plan refuses that combination).
    """

    def __init__(self, plan: Plan, run_dir: Path, *, start_step: int):
        self.metrics = MetricsFile(run_dir / "metrics.jsonl") if plan.logger.metrics_jsonl else None
        self.records: list[dict[str, Any]] = []
        if self.metrics is not None:
            self.metrics.truncate_after(start_step - 1)
            self.records = self.metrics.read()
        self.wandb = WandbLogger(plan.logger, run_dir, run_name=plan.name, config=plan_to_dict(plan))
        # A multi-LoRA run's iterations are not steps: each adapter takes its own num_step, over as many iterations.
        total = 0 if plan.capabilities.multi_lora else plan.batch.num_steps
        self.progress = Progress(total, mode=plan.logger.progress, start_step=start_step)
        self.plan, self.run_dir = plan, run_dir

    def phase(self, step: int, name: str) -> None:
        self.progress.phase_started(step, name)

    def step_done(self, step: int, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append(record)
        self.records.append(record)
        self.wandb.log({k: v for k, v in record.items() if v is not None and k != "step"}, step=step)
        shown = {
            k: record[k]
            for k in ("reward/mean", "train/loss", "train/kl", "rollout/tokens_per_s")
            if record.get(k) is not None
        }
        self.progress.step_done(step, shown)

    def close(self) -> None:
        self.progress.close()
        self.wandb.finish()
        if self.plan.logger.plots and self.records:
            plot_metrics(self.records, self.run_dir / "metrics.png")
        print(summary_table(self.records))
