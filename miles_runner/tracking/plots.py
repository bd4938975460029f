"""The end-of-run PNG: reward, loss, KL and throughput per step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PANELS = (("reward", "reward/mean"), ("loss", "train/loss"), ("KL", "train/kl"), ("tokens/s", "rollout/tokens_per_s"))


def plot_metrics(records: list[dict[str, Any]], out: Path, *, prefix: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (title, key) in zip(axes, PANELS, strict=True):
        points = [(r["step"], r[prefix + key]) for r in records if r.get(prefix + key) is not None]
        if points:
            steps, values = zip(*points, strict=True)
            ax.plot(steps, values, marker=".", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def summary_table(records: list[dict[str, Any]], window: int = 5) -> str:
    """First vs last steps of the headline metrics, as a small console table."""
    if not records:
        return "no steps were recorded"
    rows = []
    for title, key in (*PANELS, ("sync s", "sync/seconds"), ("logprob |diff|", "train/logprob_abs_diff")):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            first = sum(values[:window]) / len(values[:window])
            last = sum(values[-window:]) / len(values[-window:])
            rows.append(f" {title:<16} {first:>10.4g} {last:>10.4g}")
    head = f" {'metric':<16} {'first ' + str(window):>10} {'last ' + str(window):>10}"
    return "\n".join([f"summary over {len(records)} steps", head, *rows])
