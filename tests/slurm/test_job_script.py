"""The Slurm launcher without a Slurm: the rendered job script of the headline recipe (a golden file; rewrite it
with UPDATE_GOLDEN=1 and review the diff), and the launcher settings that contradict the plan, which are plan
errors naming the field and the fix."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles_runner.cli.main import main
from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.slurm.contradictions import EXECUTOR_OVERRIDES, executor_problems, settings_problems
from miles_runner.slurm.script import JOB_LOG, job_body, render_job_script
from miles_runner.slurm.settings import SlurmSettings
from miles_testkit.plan_errors import printed_rules as rules

pytestmark = pytest.mark.integration

GOLDEN = Path(__file__).parent / "golden"
TINY = "+recipe=tiny_lora_agentic"
SLURM = "hydra/launcher=miles_slurm"
GLM_SETTINGS = SlurmSettings(
    partition="gpu",
    account="rl",
    qos="high",
    time="24:00:00",
    cpus_per_task=96,
    mem="0",
    setup=["module load cuda/12.4", "source /opt/miles/venv/bin/activate"],
    extra_sbatch=["--exclusive"],
    nodes_timeout_s=600,
)


def test_the_glm52_job_script_matches_the_reviewed_golden_file():
    plan = compile_design(compose(["+recipe=glm52_lora_agentic", *EXECUTOR_OVERRIDES]))
    script = render_job_script(plan, GLM_SETTINGS, "/shared/sweeps/glm52/0", "/opt/miles/venv/bin/python")
    golden = GOLDEN / "glm52_lora_agentic.sbatch"
    if os.environ.get("UPDATE_GOLDEN") or not golden.exists():
        golden.write_text(script)
    assert script == golden.read_text()


def test_the_glm52_job_script_is_valid_bash_and_starts_a_ray_per_node():
    script = (GOLDEN / "glm52_lora_agentic.sbatch").read_text()
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    assert "--head --block" in script and 'miles_node_0": 1000' in script and "K < 4" in script


def test_a_single_node_job_keeps_ray_on_loopback():
    plan = compile_plan(compose([TINY, *EXECUTOR_OVERRIDES]))
    script = render_job_script(plan, SlurmSettings(), "/jobs/0", "python")
    assert "HEAD_IP=127.0.0.1" in script and "hostname -I" not in script and "K < " not in script


def test_a_job_starts_its_processes_itself_whatever_warm_start_server_the_submitter_named(tmp_path):
    # sbatch hands the job the submitter's environment; the job drops MILES_WARM_START before it starts anything.
    plan = compile_plan(compose([TINY, *EXECUTOR_OVERRIDES]))
    body = job_body(plan, SlurmSettings(), tmp_path, sys.executable)
    until_ray = body[: body.index("RAY_PIDS=()")] + 'echo "warm start: ${MILES_WARM_START-unset}"\n'
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho node0\n")  # what `scontrol show hostnames` prints
    (tmp_path / "scontrol").chmod(0o755)
    env = {
        **os.environ,
        "MILES_WARM_START": "/tmp/submitter.sock",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "n0",
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
    }
    assert subprocess.run(["bash", "-c", until_ray], env=env, timeout=60).returncode == 0
    assert "warm start: unset" in (tmp_path / JOB_LOG).read_text()


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        (SlurmSettings(nodes=2), "cluster.nodes=2"),
        (SlurmSettings(gpus_per_node=8), "cluster.gpus_per_node=8"),
        (SlurmSettings(tasks_per_node=8), "drop hydra.launcher.tasks_per_node"),
        (SlurmSettings(extra_sbatch=["--nodes=4"]), "cluster.nodes=4 and drop the line"),
        (SlurmSettings(extra_sbatch=["#SBATCH --gres=gpu:8"]), "cluster.gpus_per_node=8 and drop the line"),
        (SlurmSettings(extra_sbatch=["--ntasks-per-node=8"]), "drop the line"),
    ],
)
def test_a_launcher_setting_that_contradicts_the_plan_is_a_plan_error(settings, fix):
    plan = compile_plan(compose([TINY, *EXECUTOR_OVERRIDES]))
    [problem] = settings_problems(plan, settings)
    assert problem.rule == "slurm-setting-contradicts-plan" and problem.fix == fix


def test_settings_that_agree_with_the_plan_are_accepted():
    plan = compile_plan(compose([TINY, *EXECUTOR_OVERRIDES]))
    assert (
        settings_problems(
            plan, SlurmSettings(nodes=1, gpus_per_node=0, tasks_per_node=1, extra_sbatch=["--constraint=h100"])
        )
        == []
    )


def test_miles_run_refuses_a_contradicting_setting_before_submitting(capsys):
    assert main([TINY, SLURM, "hydra.launcher.nodes=2", "--plan"]) == 2
    err = capsys.readouterr().err
    assert rules(err) == ["slurm-setting-contradicts-plan"] and "fix: cluster.nodes=2" in err


def test_an_explicit_executor_other_than_the_jobs_ray_is_a_plan_error(capsys):
    assert [p.rule for p in executor_problems(["executor=local", "executor.ray_address=10.0.0.1:6379"])] == [
        "slurm-executor-contradiction"
    ] * 2
    assert executor_problems(["executor=ray", "executor.ray_address=auto"]) == []
    assert main([TINY, SLURM, "executor=local", "--plan"]) == 2
    assert "fix: drop executor=local" in capsys.readouterr().err


def test_plan_prints_each_jobs_script_and_submits_nothing(capsys, tmp_path):
    assert main(["-m", TINY, SLURM, "run.seed=1,2", f"hydra.sweep.dir={tmp_path}", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.count("#!/bin/bash") == 2 and f"JOB_DIR={tmp_path}/1" in out
    assert "executor=ray executor.ray_address=auto" in out  # the jobs run under their own Ray
    assert not list(tmp_path.iterdir())


def test_plan_of_a_recipe_this_release_refuses_prints_its_design_labelled_not_submittable(capsys):
    assert main(["+recipe=glm52_lora_agentic", "adapters.lora_type=canonical_lora", SLURM, "--plan"]) == 2
    captured = capsys.readouterr()
    assert "# NOT SUBMITTABLE" in captured.out and "#SBATCH --nodes=4" in captured.out
    assert "megatron-lora-layout-not-built" in captured.err


def test_the_wait_for_nodes_names_each_missing_node_and_where_to_look():
    from miles_runner.slurm.wait_nodes import missing_report

    report = missing_report(3, {0}, ["gpu-a", "gpu-b"], Path("/jobs/0"), 60)
    assert "2 of the job's 3 Ray nodes did not join within 60 s" in report
    assert "plan node 1 (miles_node_1) on host gpu-b; its Ray log: /jobs/0/logs/ray-node-1.log" in report
    assert "plan node 2 (miles_node_2) not in the allocation (2 node(s): gpu-a gpu-b)" in report


def test_status_of_a_folder_that_was_not_submitted_says_so(tmp_path, capsys):
    assert main(["--status", str(tmp_path)]) == 2
    assert "not a sweep submitted to Slurm" in capsys.readouterr().err
