"""Hydra's own settings: hydra.run.dir is the run folder of a single run, hydra.sweep.* place a sweep's jobs,
and every hydra.* setting miles-run does not implement is refused with a reason and a fix, never ignored."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles_runner.cli.main import main
from miles_runner.config.hydra_settings import hydra_setting_problems
from miles_runner.plan.record import read_plan
from miles_testkit.plan_errors import printed_rules as rules

pytestmark = pytest.mark.integration

RECIPE = "+recipe=tiny_lora_agentic"


def test_hydra_run_dir_is_the_run_folder_exactly(tmp_path, capsys):
    folder = tmp_path / "runs" / "first"
    assert main([RECIPE, f"hydra.run.dir={folder}", "--plan"]) == 0
    assert {p.name for p in folder.iterdir()} == {"plan.yaml", "config.yaml", "provenance.json"}
    assert f"-> {folder / 'plan.yaml'}" in capsys.readouterr().out
    assert [p.parent for p in tmp_path.rglob("plan.yaml")] == [folder]


def test_hydra_run_dir_resolves_interpolations(tmp_path):
    assert main([RECIPE, f"hydra.run.dir={tmp_path}/${{run.name}}/${{now:%Y}}", "--plan"]) == 0
    [plan] = list(tmp_path.rglob("plan.yaml"))
    assert plan.parent.parent.name == "tiny_lora_agentic" and plan.parent.name.isdigit()


def test_hydra_run_dir_set_in_a_user_recipe_is_honoured(tmp_path):
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    folder = tmp_path / "from_recipe"
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text(
        f"# @package _global_\ndefaults:\n  - /recipe/tiny_lora_agentic\nhydra:\n  run:\n    dir: {folder}\n"
    )
    assert main(["+recipe=mine", "--config-dir", str(tmp_path / "conf"), "--plan"]) == 0
    assert (folder / "plan.yaml").is_file()


def test_a_new_run_never_overwrites_the_run_in_hydra_run_dir(tmp_path, capsys):
    assert main([RECIPE, f"hydra.run.dir={tmp_path}", "--plan"]) == 0
    before = (tmp_path / "plan.yaml").read_text()
    assert main([RECIPE, f"hydra.run.dir={tmp_path}", "optimizer.lr=0.5", "--plan"]) == 2
    err = capsys.readouterr().err
    assert rules(err) == ["run-folder-taken"] and "fix: run.resume=true" in err
    assert (tmp_path / "plan.yaml").read_text() == before


def test_run_resume_with_hydra_run_dir_resumes_that_folder(tmp_path, capsys):
    assert main([RECIPE, f"hydra.run.dir={tmp_path}", "--plan"]) == 0
    capsys.readouterr()
    assert main([RECIPE, f"hydra.run.dir={tmp_path}", "run.resume=true", "--plan"]) == 0
    assert f"-> {tmp_path / 'plan.yaml'}" in capsys.readouterr().out
    assert main([RECIPE, f"hydra.run.dir={tmp_path / 'empty'}", "run.resume=true", "--plan"]) == 2
    err = capsys.readouterr().err
    assert rules(err) == ["resume-needs-a-run-folder"] and f"hydra.run.dir={tmp_path / 'empty'}" in err


def test_hydra_run_dir_with_run_output_root_or_run_dir_is_one_folder_too_many(tmp_path, capsys):
    assert (
        main(
            [
                RECIPE,
                f"hydra.run.dir={tmp_path / 'a'}",
                f"run.output_root={tmp_path / 'b'}",
                f"run.dir={tmp_path / 'c'}",
                "--plan",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert rules(err) == ["run-folder-set-twice", "run-folder-set-twice"]
    assert "run.output_root would have no effect" in err and "fix: drop run.output_root" in err
    assert not list(tmp_path.rglob("plan.yaml"))


def test_unimplemented_hydra_settings_are_refused_with_every_other_problem(tmp_path, capsys):
    assert (
        main(
            [
                RECIPE,
                "hydra.job.chdir=true",
                "hydra.verbose=true",
                f"hydra.sweep.dir={tmp_path}",
                "hydra/launcher=basic",
                "pause_generation_mode=abort",
                "--plan",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert rules(err) == [
        "hydra-chdir-unsupported",
        "hydra-setting-unsupported",
        "hydra-setting-needs-multirun",
        "hydra-setting-needs-multirun",
        "session-needs-resumable-pause",
    ]
    assert "hydra.verbose=true  (command line)" in err and "fix: drop hydra.verbose=true" in err
    assert "fix: add --multirun" in err
    assert not list(tmp_path.rglob("plan.yaml"))


def test_hydra_job_chdir_false_is_what_miles_run_does_anyway():
    assert hydra_setting_problems(["hydra.job.chdir=false", "hydra.searchpath=[]"], multirun=False) == []


def test_hydra_job_chdir_set_by_a_config_file_is_refused(tmp_path, capsys):
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "cd.yaml").write_text("# @package _global_\nhydra:\n  job:\n    chdir: true\n")
    assert main(["+recipe=cd", "--config-dir", str(tmp_path), "--plan"]) == 2
    err = capsys.readouterr().err
    assert "hydra-chdir-unsupported" in err and "hydra.job.chdir=true  (a config file)" in err


def test_hydra_searchpath_must_be_written_plainly_for_hydra_to_read_it():
    [problem] = hydra_setting_problems(["++hydra.searchpath=[file:///x]"], multirun=False)
    assert problem.rule == "hydra-searchpath-spelling" and problem.fix == "hydra.searchpath=[file:///x]"


def test_a_sweep_refuses_hydra_run_dir_and_accepts_its_own_settings():
    [problem] = hydra_setting_problems(
        [
            "hydra.run.dir=x",
            "hydra.sweep.dir=s",
            "hydra.sweep.subdir=n",
            "hydra/launcher=miles_slurm",
            "hydra.launcher.partition=gpu",
        ],
        multirun=True,
    )
    assert problem.rule == "hydra-run-dir-in-sweep" and problem.fix == "hydra.sweep.dir=x"


def test_a_launcher_setting_the_chosen_launcher_does_not_have_is_refused_with_the_valid_ones():
    [basic] = hydra_setting_problems(["hydra.launcher.n_jobs=2"], multirun=True)  # Hydra's basic launcher: none
    assert basic.rule == "hydra-launcher-setting-unknown" and "its settings: none" in basic.reason
    [slurm] = hydra_setting_problems(["hydra/launcher=miles_slurm", "hydra.launcher.partiton=gpu"], multirun=True)
    assert slurm.rule == "hydra-launcher-setting-unknown" and "partition" in slurm.fix and "requeue" in slurm.fix


def sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles_runner.cli", "--multirun", "--plan", RECIPE, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
    )


@pytest.mark.timeout(120)
def test_a_sweep_honours_hydra_sweep_dir_and_subdir(tmp_path):
    done = sweep(
        "session=v1,v2", f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=job${hydra.job.num}", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.parent.name for p in (tmp_path / "sweep").rglob("plan.yaml")) == ["job0", "job1"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.timeout(120)
def test_a_sweep_puts_its_jobs_under_run_output_root(tmp_path):
    done = sweep("session=v1,v2", f"run.output_root={tmp_path / 'out'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    plans = sorted((tmp_path / "out" / "multirun").rglob("plan.yaml"))
    assert {read_plan(p).session.version for p in plans} == {"v1", "v2"}
    assert not (tmp_path / "outputs").exists()
    assert json.loads((plans[0].parent / "provenance.json").read_text())["recipe"] == "tiny_lora_agentic"


def test_a_sweep_over_run_output_root_is_refused(capsys):
    assert main(["--multirun", "--plan", RECIPE, "run.output_root=a,b"]) == 2
    assert "sweep-needs-one-output-root" in capsys.readouterr().err
