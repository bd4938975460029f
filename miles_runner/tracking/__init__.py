"""Tracking: metrics.jsonl, wandb, progress display, plots and the end-of-run summary."""
