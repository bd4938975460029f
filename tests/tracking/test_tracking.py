"""Progress, metrics file, plot and summary: what a user sees of a run."""

import io
import json

import pytest

from miles_runner.tracking.metrics import MetricsFile
from miles_runner.tracking.plots import plot_metrics, summary_table
from miles_runner.tracking.progress import Progress

RECORDS = [
    {
        "step": i,
        "reward/mean": 0.1 * i,
        "train/loss": 1.0 - 0.1 * i,
        "rollout/tokens_per_s": 100.0 + i,
        "train/kl": None,
    }
    for i in range(8)
]


def test_progress_without_a_terminal_prints_plain_lines():
    out = io.StringIO()
    progress = Progress(3, mode="auto", stream=out)
    progress.phase_started(0, "rollout")
    progress.step_done(0, {"reward/mean": 0.25})
    progress.close()
    assert out.getvalue() == "step 1/3 reward/mean=0.25\n"


@pytest.mark.parametrize("mode", ["plain", "rich"])
def test_a_run_without_a_step_total_counts_iterations(mode):
    """A multi-LoRA run iterates until each adapter has taken its own steps: no "61/60"."""
    out = io.StringIO()
    progress = Progress(0, mode=mode, stream=out)
    progress.step_done(60, {"reward/mean": 0.5})
    progress.close()
    assert "iteration 61 reward/mean=0.5" in out.getvalue() and "/0" not in out.getvalue()


def test_progress_on_a_terminal_draws_a_live_bar_and_keeps_step_lines():
    out = io.StringIO()
    progress = Progress(3, mode="rich", stream=out)
    progress.phase_started(0, "train")
    progress.step_done(0, {"reward/mean": 0.5})
    progress.close()
    assert "step 1/3 reward/mean=0.5" in out.getvalue()
    assert "━" in out.getvalue()


def test_metrics_file_appends_and_a_resume_drops_steps_it_will_redo(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    for record in RECORDS[:5]:
        metrics.append(record)
    metrics.truncate_after(2)
    assert [r["step"] for r in metrics.read()] == [0, 1, 2]
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["reward/mean"] == 0.0


def test_non_finite_values_are_written_as_null(tmp_path):
    metrics = MetricsFile(tmp_path / "metrics.jsonl")
    metrics.append({"step": 0, "train/loss": float("nan")})
    assert metrics.read() == [{"step": 0, "train/loss": None}]


def test_plot_is_a_png_with_every_panel(tmp_path):
    path = plot_metrics(RECORDS, tmp_path / "metrics.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_compares_the_first_and_last_steps():
    table = summary_table(RECORDS, window=2)
    reward_row = next(line for line in table.splitlines() if line.strip().startswith("reward"))
    assert reward_row.split()[1:] == ["0.05", "0.65"]
