"""`miles-run` end to end as a user runs it: exit codes, the run folder, sweeps, and no heavy imports."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from miles_runner.cli.main import main, sweep_points
from miles_runner.config.compose import RECIPES_DIR, compose
from miles_runner.core.faults import FREEZE_ROLLOUT_ADAPTER, warn_fault_switches
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.record import read_plan

pytestmark = pytest.mark.integration


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_runner.cli", *args], cwd=cwd, capture_output=True, text=True)


def only_run_dir(root: Path) -> Path:
    [plan] = list(root.rglob("plan.yaml"))
    return plan.parent


def test_recipes_lists_every_recipe_with_a_description(capsys):
    assert main(["--recipes"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    assert all(len(line.split()) > 3 for line in lines)


def test_plan_flag_writes_plan_config_and_provenance(tmp_path, capsys):
    assert main(["+recipe=tiny_multi_lora", "--plan", f"run.output_root={tmp_path}"]) == 0
    out = capsys.readouterr().out
    run_dir = only_run_dir(tmp_path)
    assert {p.name for p in run_dir.iterdir()} == {"plan.yaml", "config.yaml", "provenance.json"}
    assert f"plan tiny_multi_lora -> {run_dir / 'plan.yaml'}" in out
    assert "1 node x 2 CPU devices (no GPU), disaggregated" in out
    assert "python -m miles_runner.embedded_engine" in out


def test_a_gpu_recipe_this_release_cannot_run_is_refused_with_what_is_missing(tmp_path, capsys):
    canonical = "adapters.lora_type=canonical_lora"
    assert main(["+recipe=glm52_lora_agentic", canonical, "--plan", f"run.output_root={tmp_path}"]) == 2
    out, err = capsys.readouterr()
    # --plan still shows what its design would run, labelled so: the Megatron-Bridge trainer at TP 8 / EP 32.
    assert out.startswith("DESIGN ONLY, NOT RUNNABLE")
    assert "megatron, 32 ranks, TP 8, EP 32" in out and "Megatron-Bridge PEFT LoRA" in out
    # canonical_lora is not built: the refusal says what to set.
    assert "megatron-lora-layout-not-built" in err and "is not built in this release" in err
    assert "fix: adapters.lora_type=lora" in err and "offload_train" not in err
    assert "multi-node" not in err  # its engines span two nodes each: SGLang runs them (--nnodes)
    assert not list(tmp_path.rglob("plan.yaml")), "nothing is written for a refused experiment"


def test_saved_plan_reads_back_identical(tmp_path):
    overrides = ["+recipe=tiny_multi_lora", f"run.output_root={tmp_path}"]
    assert main([*overrides, "--plan"]) == 0
    assert read_plan(only_run_dir(tmp_path) / "plan.yaml") == compile_plan(compose(overrides))


def test_resolved_config_records_command_line_values(tmp_path):
    assert main(["+recipe=tiny_lora_agentic", "optimizer.lr=0.01", "--plan", f"run.output_root={tmp_path}"]) == 0
    config = yaml.safe_load((only_run_dir(tmp_path) / "config.yaml").read_text())
    assert config["optimizer"]["lr"] == 0.01
    assert config["session"]["version"] == "v1"


def test_provenance_records_overrides_choices_git_and_versions(tmp_path):
    assert main(["+recipe=tiny_lora_agentic", "session=v2", "--plan", f"run.output_root={tmp_path}"]) == 0
    prov = json.loads((only_run_dir(tmp_path) / "provenance.json").read_text())
    assert "session=v2" in prov["overrides"]
    assert prov["choices"]["session"] == {"option": "v2", "from": "command line"}
    assert prov["choices"]["topology"]["from"] == "recipe tiny_lora_agentic"
    assert set(prov["git"]) == {"repo", "commit", "dirty"}
    assert prov["packages"]["hydra-core"]


def test_provenance_records_a_set_fault_switch_and_only_then(tmp_path, monkeypatch):
    assert main(["+recipe=tiny_lora_agentic", "--plan", f"run.output_root={tmp_path / 'clean'}"]) == 0
    assert json.loads((only_run_dir(tmp_path / "clean") / "provenance.json").read_text())["fault_switches"] == {}
    monkeypatch.setenv(FREEZE_ROLLOUT_ADAPTER, "1")
    assert main(["+recipe=tiny_lora_agentic", "--plan", f"run.output_root={tmp_path / 'faulty'}"]) == 0
    prov = json.loads((only_run_dir(tmp_path / "faulty") / "provenance.json").read_text())
    assert list(prov["fault_switches"]) == [FREEZE_ROLLOUT_ADAPTER]


def test_a_set_fault_switch_is_warned_about_on_stderr(monkeypatch, capsys):
    assert warn_fault_switches() == {}
    monkeypatch.setenv(FREEZE_ROLLOUT_ADAPTER, "1")
    assert list(warn_fault_switches()) == [FREEZE_ROLLOUT_ADAPTER]
    assert f"FAULT SWITCH {FREEZE_ROLLOUT_ADAPTER}=1" in capsys.readouterr().err


def test_rejected_experiment_exits_2_with_every_problem_and_no_traceback(tmp_path):
    done = run_cli(
        "+recipe=qwen3_30b_a3b_r3_session",
        "pause_generation_mode=abort",
        "topology=colocated",
        "adapters=multi",
        f"run.output_root={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("miles-run: this experiment cannot run (")
    assert "session-needs-resumable-pause" in done.stderr and "multi-lora-needs-disaggregated" in done.stderr
    assert not list(tmp_path.rglob("plan.yaml")), "nothing is written for a rejected experiment"


def test_unknown_flag_exits_2(capsys):
    assert main(["--plna"]) == 2
    assert "unknown option --plna" in capsys.readouterr().err


def test_plan_path_imports_no_heavy_package(tmp_path):
    code = (
        "import sys; from miles_runner.cli.main import main; "
        f"main(['+recipe=tiny_multi_lora', '--plan', 'run.output_root={tmp_path}']); "
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'sglang', 'peft') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_sweep_points_expand_like_hydra_basic_sweeper():
    points = sweep_points(["session=v1,v2", "optimizer.lr=0.1,0.2", "+recipe=tiny_lora_agentic"])
    assert len(points) == 4
    assert ["session=v1", "optimizer.lr=0.1", "+recipe=tiny_lora_agentic"] in points


def test_multirun_checks_every_point_before_launching(tmp_path):
    done = run_cli(
        "--multirun",
        "--plan",
        "+recipe=tiny_lora_agentic",
        "pause_generation_mode=abort,in_place",
        f"run.output_root={tmp_path}",
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert "sweep point [+recipe=tiny_lora_agentic pause_generation_mode=abort" in done.stderr
    assert not (tmp_path / "outputs").exists(), "no job was launched"


@pytest.mark.timeout(120)
def test_multirun_launches_one_job_per_point(tmp_path):
    done = run_cli("--multirun", "--plan", "+recipe=tiny_lora_agentic", "session=v1,v2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plans = sorted((tmp_path / "outputs" / "multirun").rglob("plan.yaml"))
    assert len(plans) == 2
    assert {read_plan(p).session.version for p in plans} == {"v1", "v2"}


def test_plan_of_a_config_with_a_real_error_prints_no_design(tmp_path, capsys):
    # A refusal for something other than what this release has not built: no design to show.
    assert (
        main(
            ["+recipe=tiny_lora_agentic", "trainer=megatron", "lora_mode=peft", "--plan", f"run.output_root={tmp_path}"]
        )
        == 2
    )
    out, err = capsys.readouterr()
    assert "DESIGN ONLY" not in out and "lora-mode-matches-trainer" in err
