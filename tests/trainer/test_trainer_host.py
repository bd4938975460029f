"""A trainer hosted in a process of its own (`trainer.python`, trainer/host.py) trains exactly as the same trainer in
the driver's process, raises what the host raised, and is named when it dies. The host here runs this very
interpreter; the CPU twins run Megatron-Bridge's (tests/loops/test_twins.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from miles_runner.core.errors import ComponentFailure
from miles_runner.plan.model import Plan
from miles_runner.trainer.host import HostedTrainer, TrainerHostError, open_trainer
from miles_runner.trainer.ranks import RankedTrainer
from tests.trainer.test_ranks import recorded_plan, samples

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def one_step(trainer) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = trainer.train(samples(0, 4, 8, 0))
    return metrics, trainer.adapter_state()


def test_a_hosted_trainer_trains_as_the_same_trainer_in_the_driver(tmp_path):
    plan, run_dir = recorded_plan(tmp_path / "hosted", f"trainer.python={sys.executable}")
    assert plan.trainer.host and plan.trainer.host.argv[0] == sys.executable
    hosted = open_trainer(plan, run_dir)
    assert isinstance(hosted, HostedTrainer)
    try:
        before = hosted.adapter_state()
        got_metrics, got = one_step(hosted)
        probe = hosted.probe_log_probs([3, 4, 5, 6])
        offloaded = hosted.offload_state()
    finally:
        hosted.close()
    assert not hosted_processes(run_dir)

    local_plan, local_dir = recorded_plan(tmp_path / "local")
    local = open_trainer(local_plan, local_dir)
    assert isinstance(local, RankedTrainer)
    try:
        assert {k: v.equal(before[k]) for k, v in local.adapter_state().items()} == dict.fromkeys(before, True)
        want_metrics, want = one_step(local)
        assert probe == local.probe_log_probs([3, 4, 5, 6])
    finally:
        local.close()
    assert got_metrics == want_metrics
    assert got.keys() == want.keys() and all(got[k].dtype == want[k].dtype and got[k].equal(want[k]) for k in want)
    assert not any(got[k].equal(before[k]) for k in got if "lora_B" in k)  # the step changed the adapter
    assert offloaded["moved_bytes"] == 0  # the FSDP trainer offloads nothing on CPU, in the host as here


def hosted_processes(run_dir: Path) -> list[int]:
    """Live processes whose command line is the host of this run folder."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"miles_runner.trainer.host" in cmdline and Path(f"/proc/{pid}/cwd").resolve() == run_dir.resolve():
            found.append(int(pid))
    return found


@contextlib.contextmanager
def hosted_trainer(tmp_path: Path) -> Iterator[tuple[HostedTrainer, Plan, Path]]:
    """A host of this interpreter for the CPU default plan, closed after the body."""
    plan, run_dir = recorded_plan(tmp_path, f"trainer.python={sys.executable}")
    hosted = HostedTrainer(plan, run_dir)
    try:
        yield hosted, plan, run_dir
    finally:
        hosted.close()


def test_a_failed_call_raises_the_hosts_error_and_the_host_serves_on(tmp_path):
    with hosted_trainer(tmp_path) as (hosted, plan, _):
        with pytest.raises(TrainerHostError, match=r"KeyError: 'adapter'\n\(trainer host traceback\)"):
            hosted.load_state_dict({})
        assert hosted.adapter_config()["r"] == plan.adapters[0].rank  # still serving


def test_a_host_that_dies_is_named_with_its_log(tmp_path):
    with hosted_trainer(tmp_path) as (hosted, _, run_dir):
        [pid] = hosted_processes(run_dir)
        os.kill(pid, signal.SIGKILL)  # injected fault: the host is OOM-killed
        with pytest.raises(ComponentFailure, match=r"trainer.*exited with code -9") as failure:
            hosted.train(samples(0, 4, 8, 0))
        assert failure.value.log_path == str(run_dir / "logs" / "trainer.log")


def test_a_checkpoint_crosses_to_a_new_host_whole(tmp_path):
    """What a resume does: the state one host saved (adapter, optimizer, RNG, step) loads into a fresh host."""
    with hosted_trainer(tmp_path / "first") as (first, _, _):
        one_step(first)
        state = first.state_dict()
        want = one_step(first)  # the step after the checkpoint
    with hosted_trainer(tmp_path / "second") as (second, _, _):
        second.load_state_dict(state)
        got = one_step(second)
    assert got[0] == want[0]
    assert all(got[1][k].equal(want[1][k]) for k in want[1])
