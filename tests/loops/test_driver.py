"""The training loop end to end on CPU: files a run leaves, the adapter it saves, and resume after SIGKILL."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from miles_runner.procs.ports import free_port, free_port_block
from tests.drivers import runner_command
from tests.run_files import files_named

pytestmark = pytest.mark.slow


def run_args(output_root: Path, steps: int, *extra: str) -> list[str]:
    return [
        "+recipe=tiny_lora_agentic",
        "session=off",
        "rollout.task=arith",
        "rollout.reward=exact_match",
        "rollout.max_turns=1",
        f"algorithm.num_steps={steps}",
        "checkpoint.interval=1",
        "logger=wandb_offline",
        f"engine.base_port={free_port_block(2)}",
        f"run.output_root={output_root}",
        *extra,
    ]


def miles_run(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline"}
    return subprocess.Popen(
        runner_command("miles_runner.cli.main", *args),
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("run")
    proc = miles_run(*run_args(root / "outputs", 2), cwd=root)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    [plan] = (root / "outputs").rglob("plan.yaml")
    return plan.parent


def test_run_logs_one_metrics_record_per_step_with_weight_versions(finished_run):
    steps = records(finished_run)
    assert [r["step"] for r in steps] == [0, 1]
    assert [r["weight_version"] for r in steps] == [1, 2]
    for record in steps:
        assert 0.0 <= record["reward/mean"] <= 1.0
        assert record["rollout/tokens_per_s"] > 0 and record["sync/seconds"] > 0
        assert record["train/logprob_abs_diff"] < 1e-3, "trainer and engine disagree on the sampled tokens"
        assert record["verify/logprob_gap"] < 1e-3  # every batch is the first one of a push, and verified


def test_run_times_each_step_and_its_start_up_milestones_in_order(finished_run):
    steps = records(finished_run)
    for record in steps:  # a step's seconds hold its rollout, train and sync (and the rest of the step)
        assert record["step/seconds"] >= record["rollout/seconds"] + record["train/seconds"] + record["sync/seconds"]
    stamps = json.loads((finished_run / "startup.json").read_text())
    order = [
        "loop_started",
        "engines_ready",
        "trainer_ready",
        "rollout_ready",
        "first_push_done",
        "first_step_done",
        "loop_ended",
    ]
    assert [stamps[name] for name in order] == sorted(stamps[name] for name in order)
    assert stamps["loop_started"] < stamps["trainer_built"] <= stamps["trainer_ready"]


def test_run_leaves_plot_checkpoints_and_offline_wandb(finished_run):
    assert (finished_run / "metrics.png").stat().st_size > 1000
    assert sorted(p.name for p in (finished_run / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert list((finished_run / "wandb").glob("offline-run-*"))


def test_final_adapter_loads_in_peft_and_differs_from_the_base(finished_run):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_runner.models.tiny_model import ensure_tiny_model

    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny-moe"))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, finished_run / "adapter")
    assert not torch.allclose(tuned(ids).logits, before)


def test_final_adapter_is_served_by_the_engine_from_lora_paths(finished_run, tmp_path):
    import httpx

    from miles_runner.models.tiny_model import ensure_tiny_model
    from miles_testkit.launch import embedded_engine_argv, start_engine

    port = free_port()
    argv = embedded_engine_argv(
        ensure_tiny_model("tiny-moe"), port, "--lora-paths", f"trained={finished_run / 'adapter'}"
    )
    engine = start_engine(argv, port=port, log_path=tmp_path / "engine.log", timeout_s=120)
    try:

        def prompt_logprobs(lora: str | None) -> list[float]:
            body = {
                "text": "What is 2 plus 3? The answer is 5.",
                "sampling_params": {"max_new_tokens": 1},
                "return_logprob": True,
                "logprob_start_len": 0,
                **({"lora_path": lora} if lora else {}),
            }
            reply = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            return [entry[0] for entry in reply.json()["meta_info"]["input_token_logprobs"][1:]]

        trained, base = prompt_logprobs("trained"), prompt_logprobs(None)
        assert len(trained) == len(base) > 5
        assert max(abs(a - b) for a, b in zip(trained, base, strict=True)) > 1e-3, "the adapter changes nothing"
    finally:
        engine.stop()


def test_sigkill_mid_run_resumes_with_no_step_lost_or_repeated(tmp_path):
    outputs = tmp_path / "outputs"
    first = miles_run(*run_args(outputs, 4), cwd=tmp_path)
    deadline = time.monotonic() + 400
    run_dir = None
    while time.monotonic() < deadline:
        plans = files_named(outputs, "plan.yaml")  # the run is writing checkpoints
        run_dir = plans[0].parent if plans else None
        if run_dir and len(records(run_dir)) >= 2:
            break
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    killed_at = len(records(run_dir))
    assert killed_at < 4, "the run finished before it could be killed"

    resumed = miles_run(*run_args(outputs, 4, f"run.dir={run_dir}", "run.resume=true"), cwd=tmp_path)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out
    assert [r["step"] for r in records(run_dir)] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in records(run_dir)] == [1, 2, 3, 4]


def test_async_schedule_overlaps_generation_and_trains_one_version_stale(tmp_path):
    outputs = tmp_path / "outputs"
    args = run_args(
        outputs,
        3,
        "topology=disaggregated",
        "topology.actor_num_gpus_per_node=1",
        "rollout.schedule=async",
        "rollout.max_weight_staleness=1",
        "algorithm.use_tis=true",
    )
    proc = miles_run(*args, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    [plan] = outputs.rglob("plan.yaml")
    steps = records(plan.parent)
    assert [r["train/weight_staleness"] for r in steps] == [0, 1, 1]
    assert [r["rollout/weight_version"] for r in steps] == [0, 0, 1]
    assert [r["weight_version"] for r in steps] == [1, 2, 3]
    assert all(r["verify/logprob_gap"] < 1e-4 for r in steps)  # every push probed on the engine (weight_sync/probe.py)


def test_a_run_on_two_trainer_ranks_trains_and_saves_its_adapter(tmp_path):
    """FSDP2 across the driver (rank 0) and a follower process (rank 1), with two engines colocated."""
    proc = miles_run(
        *run_args(
            tmp_path / "outputs",
            2,
            "topology.actor_num_gpus_per_node=2",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
        ),
        cwd=tmp_path,
    )
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    [plan] = (tmp_path / "outputs").rglob("plan.yaml")
    run_dir = plan.parent
    assert [r["step"] for r in records(run_dir)] == [0, 1]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    assert "miles_runner.trainer.ranks" in (run_dir / "logs" / "trainer1.log").read_text()
