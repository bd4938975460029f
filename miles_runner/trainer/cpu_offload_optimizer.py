"""``optimizer.cpu_offload``: Megatron's HybridDeviceOptimizer, built as megatron-core's get_megatron_optimizer
builds it for ``--optimizer-cpu-offload`` (megatron/core/optimizer/__init__.py), with the settings miles' GLM-5 and
fully-async recipes pass: ``--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d
--use-precision-aware-optimizer`` and megatron's defaults for the rest (offload fraction 1: every parameter's
state and update on the host; pinned host copies of the parameters and gradients).

The optimizer keeps fp32 host copies of the GPU parameters, steps torch's AdamW (or SGD) on them on the CPU, and
copies the result back, the device-to-host and host-to-device copies overlapped on side CUDA streams. It offloads
GPU parameters only: on a CPU host the state is in host memory already, and the trainer's own torch optimizer is
the same update (the plan's summary says so)."""

from __future__ import annotations

from typing import Any

import torch

from miles_runner.config.schema import OptimizerConfig

OFFLOAD_FRACTION = 1.0  # megatron's --optimizer-offload-fraction default
OVERLAP_D2H_H2D = True  # --overlap-cpu-optimizer-d2h-h2d
PIN_CPU_COPIES = True  # megatron's pin_cpu_grads / pin_cpu_params defaults


def offloads(params: list[torch.nn.Parameter]) -> bool:
    """Whether there is anything to offload: parameters on a GPU."""
    return any(p.is_cuda for p in params)


def hybrid_device_optimizer(params: list[torch.nn.Parameter], cfg: OptimizerConfig, lr: float) -> Any:
    """megatron-core's HybridDeviceOptimizer over `params` (GPU tensors) with megatron's arguments for `cfg`."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    if cfg.name == "adam":
        from megatron.core.optimizer import Adam as gpu_adam  # TE's FusedAdam, else torch's AdamW

        classes = {"cpu_optimizer_cls": torch.optim.AdamW, "gpu_optimizer_cls": gpu_adam}
        defaults: dict[str, Any] = dict(
            lr=lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=1e-8,  # megatron's adam_eps default, as the trainer's own AdamW
            bias_correction=True,
            fused=True,
        )
    elif cfg.name == "sgd":
        from megatron.core.optimizer import SGD as gpu_sgd

        classes = {"cpu_optimizer_cls": torch.optim.SGD, "gpu_optimizer_cls": gpu_sgd}
        defaults = dict(lr=lr, weight_decay=cfg.weight_decay, momentum=0.0)
    else:
        raise ValueError(f"optimizer.cpu_offload offloads adam or sgd (megatron's), not {cfg.name!r}")
    return HybridDeviceOptimizer(
        params,
        offload_fraction=OFFLOAD_FRACTION,
        overlap_cpu_optimizer_d2h_h2d=OVERLAP_D2H_H2D,
        pin_cpu_grads=PIN_CPU_COPIES,
        pin_cpu_params=PIN_CPU_COPIES,
        param_update_in_fp32=True,  # --use-precision-aware-optimizer: the update in fp32 on the host copies
        **classes,
        **defaults,
    )
