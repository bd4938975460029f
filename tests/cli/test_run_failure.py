"""A failing run ends cleanly: one report naming the component, its reason, its log's tail and the run folder;
the traceback in RUN_DIR/logs/driver.log (and on the console only with --debug); every process stopped; and
RUN_DIR/result.json says how it ended (failed, interrupted; completed: tests/cli/test_sweep_summary.py)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from miles_runner.procs.ports import free_port_block, port_is_free
from miles_runner.tracking.job_result import FAILED, INTERRUPTED, read_records, read_result
from tests.drivers import runner_command
from tests.run_files import files_named

pytestmark = pytest.mark.integration

DRIVER_FRAME = "miles_runner/loops/run.py"  # every traceback of a failed run passes through the dispatcher


def run_args(output_root: Path, base_port: int, *extra: str) -> list[str]:
    return [
        "session=off",
        "algorithm.num_steps=3",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_response_len=4",
        f"engine.base_port={base_port}",
        f"run.output_root={output_root}",
        "logger=none",
        *extra,
    ]


def miles_run(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        runner_command("miles_runner.cli.main", *args),
        cwd=cwd,
        text=True,
        env={**os.environ, "WANDB_MODE": "offline"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def run_dir_of(output_root: Path) -> Path:
    [plan] = output_root.rglob("plan.yaml")
    return plan.parent


def engine_pid(port: int) -> int | None:
    """The embedded engine serving `port` (found by its command line, as `ps` would)."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"miles_runner.embedded_engine" in argv and str(port).encode() in argv:
            return int(proc.name)
    return None


def assert_one_clean_report(stderr: str, run_dir: Path, component: str) -> None:
    assert stderr.count("miles-run: the run failed") == 1, stderr
    assert f"component: {component}" in stderr, stderr
    assert "reason:" in stderr and f"--- last lines of {run_dir / 'logs' / component}.log ---" in stderr, stderr
    assert f"run folder: {run_dir}" in stderr, stderr
    assert "Traceback" in (run_dir / "logs" / "driver.log").read_text()


def test_an_engine_that_cannot_start_is_named_with_its_log_and_no_traceback(tmp_path):
    port = free_port_block(2)
    empty_model = tmp_path / "empty-model"  # a folder without config.json: the engine fails on its own, offline
    empty_model.mkdir()
    proc = miles_run(*run_args(tmp_path / "out", port, f"model.path={empty_model}"), cwd=tmp_path)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    run_dir = run_dir_of(tmp_path / "out")
    assert_one_clean_report(stderr, run_dir, "engine0")
    assert DRIVER_FRAME not in stderr, "the driver's traceback belongs in driver.log"
    last_line = (run_dir / "logs" / "engine0.log").read_text().splitlines()[-1]
    assert last_line in stderr, "the engine's own log tail says what is wrong"
    assert port_is_free("127.0.0.1", port) and port_is_free("127.0.0.1", port + 1)
    result = read_result(run_dir)
    assert (result.status, result.exit_code, result.steps, result.final_reward) == (FAILED, 1, 0, None)


def test_debug_also_prints_the_traceback(tmp_path):
    port = free_port_block(2)
    (tmp_path / "empty-model").mkdir()
    proc = miles_run(
        *run_args(tmp_path / "out", port, f"model.path={tmp_path / 'empty-model'}"), "--debug", cwd=tmp_path
    )
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "component: engine0" in stderr and DRIVER_FRAME in stderr


@pytest.mark.slow
def test_an_engine_killed_mid_run_is_named_and_every_process_stops(tmp_path):
    port = free_port_block(2)
    proc = miles_run(*run_args(tmp_path / "out", port, "algorithm.num_steps=50"), cwd=tmp_path)
    pid = wait_for_first_step(proc, tmp_path / "out", port + 1)
    os.kill(pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    run_dir = run_dir_of(tmp_path / "out")
    assert_one_clean_report(stderr, run_dir, "engine1")
    assert "exited with code -9" in stderr and DRIVER_FRAME not in stderr
    assert engine_pid(port) is None and port_is_free("127.0.0.1", port)


def wait_for_first_step(proc: subprocess.Popen, output_root: Path, engine_port: int) -> int:
    """The pid of the engine on `engine_port`, once the run has recorded a step."""
    deadline = time.monotonic() + 300
    while (pid := engine_pid(engine_port)) is None or not any(
        read_records(m.parent) for m in files_named(output_root, "metrics.jsonl")
    ):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return pid


@pytest.mark.slow
def test_ctrl_c_stops_the_run_and_its_result_says_interrupted(tmp_path):
    port = free_port_block(2)
    proc = miles_run(*run_args(tmp_path / "out", port, "algorithm.num_steps=50"), cwd=tmp_path)
    wait_for_first_step(proc, tmp_path / "out", port)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "stopped by Ctrl-C" in stderr, stderr
    run_dir = run_dir_of(tmp_path / "out")
    result, records = read_result(run_dir), read_records(run_dir)
    assert (result.status, result.exit_code) == (INTERRUPTED, 130)
    assert result.steps == records[-1]["step"] + 1 < 50 and result.final_reward == records[-1]["reward/mean"]
    assert engine_pid(port) is None and port_is_free("127.0.0.1", port)
