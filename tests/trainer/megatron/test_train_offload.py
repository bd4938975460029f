"""Training offload on the Megatron trainer (trainer/train_offload.py): its frozen weights, gradients and optimizer
state leave between trains and come back, and training goes on exactly as if they had stayed; the adapter's own
parameters (what a colocated push reads) never move."""

from __future__ import annotations

import pytest
import torch

from miles_runner.config.schema import OptimizerConfig
from miles_runner.trainer.megatron import parallel
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.train_offload import OffloadSettings

from ..settings import make_settings
from .test_trainer import samples

pytestmark = pytest.mark.integration

ADAM = OptimizerConfig(name="adam", lr=0.05)


def trainer(model_path: str, offload: OffloadSettings | None) -> MegatronTrainer:
    return MegatronTrainer(model_path, make_settings(optimizer=ADAM, offload=offload), parallel.Layout())


def frozen(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}


def test_disk_offload_frees_the_state_in_chunks_and_training_goes_on_as_if_it_had_stayed(tiny_model_path, tmp_path):
    resident = trainer(tiny_model_path, None)
    resident.train(samples())
    base = frozen(resident)
    settings = OffloadSettings("disk", str(tmp_path / "scratch"), chunk_mb=1)
    offloaded = trainer(tiny_model_path, settings)
    offloaded.train(samples())
    lora_homes = {n: p.data_ptr() for n, p in offloaded.model.named_parameters() if p.requires_grad}

    report = offloaded.offload_state()
    chunks = sorted((tmp_path / "scratch" / "rank0").glob("chunk*.safetensors"))
    state = offloaded.optimizer.state
    assert report["target"] == "disk" and report["moved_bytes"] >= sum(t.nbytes for t in base.values())
    assert len(chunks) > 1 and all(c.stat().st_size <= 2**20 + 2**16 for c in chunks)  # chunk_mb, plus a header
    assert all(p.numel() == 0 for p in offloaded.model.parameters() if not p.requires_grad)
    assert all(p.grad is None for p in offloaded.model.parameters())
    assert all(s["exp_avg"].numel() == 0 and s["exp_avg_sq"].numel() == 0 for s in state.values())
    assert {n: p.data_ptr() for n, p in offloaded.model.named_parameters() if p.requires_grad} == lora_homes

    second = offloaded.train(samples())  # brings the state back first
    assert not list((tmp_path / "scratch" / "rank0").glob("*")) and frozen(offloaded).keys() == base.keys()
    assert all(torch.equal(frozen(offloaded)[n], t) for n, t in base.items())
    again = trainer(tiny_model_path, None)
    again.train(samples())
    expected = again.train(samples())
    assert second["loss"] == expected["loss"]
    mine, theirs = offloaded.adapter_state(), again.adapter_state()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_cpu_offload_on_a_cpu_host_moves_nothing(tiny_model_path):
    model = trainer(tiny_model_path, OffloadSettings("cpu"))
    model.train(samples())
    pointers = {n: p.data_ptr() for n, p in model.model.named_parameters()}
    assert model.offload_state()["moved_bytes"] == 0
    assert {n: p.data_ptr() for n, p in model.model.named_parameters()} == pointers
    assert model.onload_state()["moved_bytes"] == 0
