"""logger.metrics_jsonl: off, the Tracker writes no metrics.jsonl and still plots and summarises the run."""

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.tracking.tracker import Tracker


def tracked_run(tmp_path, *overrides: str) -> Tracker:
    plan = compile_plan(compose(["logger.wandb_mode=disabled", "logger.progress=plain", *overrides]))
    tracker = Tracker(plan, tmp_path, start_step=0)
    for step in range(3):
        tracker.step_done(step, {"step": step, "reward/mean": 0.1 * step, "train/loss": 1.0 - 0.1 * step})
    tracker.close()
    return tracker


def test_without_metrics_jsonl_no_file_is_written_and_the_plot_and_summary_still_cover_every_step(tmp_path, capsys):
    tracker = tracked_run(tmp_path, "logger.metrics_jsonl=false")
    assert not (tmp_path / "metrics.jsonl").exists()
    assert [r["step"] for r in tracker.records] == [0, 1, 2]
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert "summary over 3 steps" in capsys.readouterr().out


def test_with_metrics_jsonl_every_step_is_appended(tmp_path):
    tracked_run(tmp_path)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3
