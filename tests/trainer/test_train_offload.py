"""TrainStateOffload on a small module (trainer/train_offload.py): what moves, in chunks of the configured size, and
that a process ending while offloaded leaves no chunks behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from miles_runner.trainer.train_offload import OffloadSettings, TrainStateOffload

TOY = textwrap.dedent(
    """
    import sys, torch
    from miles_runner.trainer.train_offload import OffloadSettings, TrainStateOffload

    def toy():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        model[0].requires_grad_(False)  # the frozen base; model[1] stands for the adapter
        optimizer = torch.optim.Adam(model[1].parameters())
        model(torch.ones(2, 256)).sum().backward()
        optimizer.step()
        return model, optimizer
    """
)


def toy() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    namespace: dict = {}
    exec(TOY, namespace)
    return namespace["toy"]()


def test_disk_offload_writes_bounded_chunks_and_restores_every_tensor(tmp_path):
    model, optimizer = toy()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    offload = TrainStateOffload(OffloadSettings("disk", str(tmp_path), chunk_mb=0.125), model, optimizer, rank=3)
    report = offload.offload()
    chunks = sorted((tmp_path / "rank3").iterdir())
    assert report.chunks == len(chunks) > 1 and all(c.stat().st_size < 0.125 * 2**20 + 2**12 for c in chunks)
    assert model[0].weight.numel() == 0 and model[1].weight.numel() == 4 * 256  # the adapter stays
    assert all(p.grad is None for p in model.parameters())
    back = offload.onload()
    assert back.moved_bytes == report.moved_bytes and not (tmp_path / "rank3").exists()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(model.get_parameter(n).grad, g) for n, g in grads.items())
    optimizer.step()  # its state came back whole: a step runs


def test_a_process_that_ends_while_offloaded_leaves_no_chunks(tmp_path):
    script = TOY + textwrap.dedent(
        f"""
        model, optimizer = toy()
        TrainStateOffload(OffloadSettings("disk", {str(tmp_path)!r}), model, optimizer, rank=0).offload()
        assert __import__("os").listdir({str(tmp_path / "rank0")!r}), "nothing was written"
        raise SystemExit("the run failed while the trainer was offloaded")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "the run failed" in done.stderr, done.stderr
    assert not (Path(tmp_path) / "rank0").exists()
