"""The CPU adaptations of megatron-core: each one's target exists in the installed version (a release that removes
one fails here and in apply_cpu_adaptations, loudly), applying twice changes nothing, untested versions are
refused, and the adapted pieces do what megatron expects of them."""

from __future__ import annotations

import importlib

import megatron.core
import pytest
import torch

from miles_runner.trainer.megatron import cpu_compat


def adapted_objects() -> tuple:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    norm = importlib.import_module("megatron.core.transformer.torch_norm").WrappedTorchNorm
    return torch.cuda.current_device, random.CudaRNGStatesTracker, norm.__new__


def test_every_adaptation_target_exists_in_the_installed_megatron_core():
    assert cpu_compat.megatron_core_version() in cpu_compat.TESTED_MEGATRON_CORE
    for adaptation in cpu_compat.ADAPTATIONS:
        for module, attribute in adaptation.targets:
            assert cpu_compat.target(module, attribute) is not None, f"{module}.{attribute}"


def test_a_removed_target_fails_loudly(monkeypatch):
    cpu_compat.apply_cpu_adaptations()
    norm = importlib.import_module("megatron.core.transformer.torch_norm")
    monkeypatch.delattr(norm, "WrappedTorchNorm")
    with pytest.raises(RuntimeError, match=r"torch_norm\.WrappedTorchNorm no longer exists"):
        cpu_compat.apply_cpu_adaptations()


def test_applying_twice_changes_nothing():
    cpu_compat.apply_cpu_adaptations()
    first = adapted_objects()
    cpu_compat.apply_cpu_adaptations()
    assert adapted_objects() == first
    assert torch.cuda.current_device() == torch.device("cpu")
    assert importlib.import_module("megatron.core.transformer.moe.moe_utils").te_general_gemm is None


def test_an_untested_megatron_core_version_is_refused(monkeypatch):
    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(RuntimeError, match=r"megatron-core 0\.17\.0 is installed.*tested on 0\.16\.1, 0\.19\.2"):
        cpu_compat.apply_cpu_adaptations()


def test_the_cpu_rng_tracker_forks_a_separate_stream():
    from megatron.core.tensor_parallel import random

    cpu_compat.apply_cpu_adaptations()
    tracker = random.CudaRNGStatesTracker()
    tracker.add("stream", 1234)
    torch.manual_seed(0)
    expected_outer = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("stream"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_outer)  # the outer stream did not move
    torch.manual_seed(1234)
    assert torch.equal(inside, torch.rand(3))  # the fork drew from its own seed
    with tracker.fork("stream"):
        assert not torch.equal(torch.rand(3), inside)  # and continues where it stopped


def test_a_sequence_parallel_norm_is_built_and_tagged():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    cpu_compat.apply_cpu_adaptations()
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    norm = WrappedTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == 1e-6
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    assert config.sequence_parallel  # the caller's config is left as it was
