"""optimizer.cpu_offload: Megatron's HybridDeviceOptimizer with the settings miles passes (offload fraction 1,
overlapped copies, the update in fp32 on the host) where there are GPU parameters to offload; on a CPU host the
trainer's own optimizer, the state being in host memory already, and the plan says so."""

from __future__ import annotations

import pytest
import torch

from miles_runner.config.schema import OptimizerConfig
from miles_runner.plan.summary import algorithm_line
from miles_runner.trainer.policy_grads import build_optimizer
from tests.compiled import compile_overrides

OFFLOADED = OptimizerConfig(name="adam", lr=0.01, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.98, cpu_offload=True)


def test_a_cpu_host_keeps_the_trainers_optimizer_and_the_plan_says_so():
    params = [torch.nn.Parameter(torch.randn(4, 3))]
    optimizer = build_optimizer(params, OFFLOADED, 0.01)
    assert type(optimizer) is torch.optim.AdamW  # the same update: megatron's host optimizer is torch's AdamW
    assert optimizer.defaults["weight_decay"] == 0.1 and optimizer.defaults["betas"] == (0.9, 0.98)
    plan = compile_overrides(["trainer=megatron", "lora_mode=raw", "optimizer.cpu_offload=true"], design=True)
    line = algorithm_line(plan)
    assert "Megatron's HybridDeviceOptimizer" in line and "on a CPU host it is there already" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="HybridDeviceOptimizer offloads GPU parameters (CUDA)")
def test_megatron_builds_the_hybrid_optimizer_with_miles_settings():
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    params = [torch.nn.Parameter(torch.randn(64, 32, device="cuda", dtype=torch.bfloat16))]
    optimizer = build_optimizer(params, OFFLOADED, 0.01)
    assert isinstance(optimizer, HybridDeviceOptimizer)
    # Read back from what Megatron built: everything offloaded, copies overlapped, the update in fp32.
    assert optimizer.offload_fraction == 1.0 and optimizer.overlap_cpu_optimizer_d2h_h2d
    assert optimizer.param_update_in_fp32 and optimizer.pin_cpu_grads and optimizer.pin_cpu_params
    assert optimizer.cpu_optimizer_cls is torch.optim.AdamW and optimizer.gpu_optimizer is None
    [host] = optimizer.cpu_optimizers
    group = host.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"]) == (0.01, 0.1, (0.9, 0.98))
    assert all(not p.is_cuda and p.dtype == torch.float32 for p in group["params"])  # fp32 host copies
    reference = torch.nn.Parameter(params[0].detach().float().cpu())
    expected = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1, betas=(0.9, 0.98))
    grad = torch.randn(64, 32)
    params[0].grad, reference.grad = grad.to("cuda", torch.bfloat16), grad.to(torch.bfloat16).float()
    optimizer.step()
    expected.step()
    torch.cuda.synchronize()
    assert torch.allclose(params[0].float().cpu(), reference.to(torch.bfloat16).float(), atol=1e-2)
