"""bench-peers' report: figures from step records (the warm-up step left out, ratios within a run), BENCHMARKS.md,
the reward plot, and the same report again from the saved results."""

import json
import sys

import pytest

from bench.peers import report
from bench.peers.records import SideRun, StepRecord, step_walls
from bench.peers.work import Work

CONTEXT = {
    "machine": {
        "cpu": "test CPU",
        "cores": 2,
        "platform": "linux",
        "python": "3.11",
        "load_before": [1, 1, 1],
        "load_after": [2, 2, 2],
    },
    "started": 0.0,
    "work": {**Work(steps=4).__dict__, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "peers": {
        "single_turn": {
            "row": "single_turn",
            "model_path": "/models/tiny",
            "task": "count",
            "reward": "exact_match",
            "max_turns": 1,
            "prompts": 8,
            "samples": 8,
            "max_new_tokens": 8,
            "lora_rank": 8,
            "lora_alpha": 16.0,
            "targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
            "lr": 0.005,
            "adam_betas": [0.9, 0.98],
            "weight_decay": 0.0,
            "clip_grad": 1.0,
            "eps_clip": 0.2,
            "eps_clip_high": 0.28,
            "kl_coef": 0.0,
            "steps": 4,
            "seed": 0,
            "temperature": 1.0,
            "top_p": 1.0,
            "std_normalized": True,
            "per_token_loss": False,
        }
    },
    "versions": {"main": {"miles-runner": "0.1"}, "peers": {"trl": "1.16.0"}},
}


def side(name: str, walls: list[float], rewards: list[float], process_s: float) -> SideRun:
    breakdown = {"rollout_s": 0.5, "train_s": 0.25, "sync_s": 0.125} if name == "miles" else {}
    steps = [
        StepRecord(i, wall, reward, **breakdown)
        for i, (wall, reward) in enumerate(zip(step_walls(walls), rewards, strict=True))
    ]
    return SideRun(name, "single_turn", process_s, steps, command=[name, "--work"])


def runs() -> list:
    # Step ends: TRL 1 s apart except a slow last step; miles 2 s apart after a 9 s first step (left out).
    return [
        {
            "single_turn": {
                "trl": side("trl", [5, 6, 7, 10], [0.1, 0.2, 0.3, 0.4], 10.0),
                "miles": side("miles", [9, 11, 13, 15], [0.1, 0.3, 0.5, 0.5], 40.0),
            }
        },
        {
            "single_turn": {
                "trl": side("trl", [5, 6, 7, 8], [0.1, 0.2, 0.2, 0.2], 12.0),
                "miles": side("miles", [9, 12, 15, 18], [0.2, 0.2, 0.2, 0.2], 36.0),
            }
        },
    ]


def test_step_times_leave_out_the_first_step_and_ratios_are_per_run():
    figures = report.row_figures(runs(), "single_turn")
    assert figures["trl"]["step_s"] == [1, 1] and figures["miles"]["step_s"] == [2, 3]
    assert figures["ratio_step"] == [2, 3] and figures["ratio_process"] == [4, 3]
    assert figures["miles"]["other_s"] == [1.125, 2.125]
    assert figures["miles"]["final_reward"] == [0.5, 0.2]
    assert figures["trl"]["last3_reward"] == pytest.approx([0.3, 0.2])


def test_a_run_of_one_step_has_no_time_per_step():
    with pytest.raises(ValueError, match="--steps"):
        side("trl", [5], [0.1], 1.0).median()


def test_the_report_has_the_figures_the_plot_and_reads_back(tmp_path, monkeypatch):
    out, results = tmp_path / "BENCHMARKS.md", tmp_path / "results"
    report.write_report(runs(), CONTEXT, out, results)
    text = out.read_text()
    assert "| single turn (`session=off`) | `miles-run` | 2.500 (2.000–3.000) |" in text
    assert "| single turn (`session=off`) | 2.50 (2.00–3.00)× | 3.50 (3.00–4.00)× | 2.00×, 3.00× |" in text
    assert "**not met** (2.50×)" in text and "![reward per step](results/peers_reward.png)" in text
    assert "  trl --work" in text and "test CPU, 2 cores" in text
    assert "per_device_train_batch_size=64, gradient_accumulation_steps=1, num_generations=8" in text
    assert (results / "peers_reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((results / "peers.json").read_text())["context"] == CONTEXT

    again = tmp_path / "again.md"
    monkeypatch.setattr(sys, "argv", ["report", str(results / "peers.json"), str(again)])
    report.main()
    assert again.read_text() == text
