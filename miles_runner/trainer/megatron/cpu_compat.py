"""What megatron-core needs to run on a CPU-only torch build (gloo), as small, checked adaptations.

megatron-core assumes CUDA in a few places (docs/development.md, "Megatron on CPU"):

1. ``torch.cuda.current_device()`` is the device of RoPE frequencies, tensor-parallel gather/scatter buffers and
   router aux tensors: on CPU it must answer the CPU.
2. The model-parallel RNG tracker keeps CUDA generator states: a tracker of CPU states replaces its class, so
   every tracker megatron creates (``initialize_rng_tracker``, ``model_parallel_cuda_manual_seed``) is a CPU one.
3. Sequence parallelism (required for TP > 1 with MoE) asserts in the torch norm that the local layer spec builds;
   building that norm without SP and tagging its parameters ``sequence_parallel`` is exact (their grads are summed
   across TP by ``finalize_model_grads``, as apex's norm is).
4. 0.16.1 only: ``moe_utils.te_general_gemm`` is undefined without Transformer Engine (a NameError in the router).

The alltoall MoE dispatcher's CUDA stream is avoided by using the allgather dispatcher (model.py), and megatron's
own DDP (which needs ``torch.cuda.current_stream``) is not used, so neither is adapted here.

Each adaptation first resolves what it replaces, so a megatron-core release that renames or removes it fails
loudly here instead of silently running unadapted code; and megatron-core versions whose adaptations were not
tested are refused. Nothing is changed when CUDA is available.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

TESTED_MEGATRON_CORE = ("0.16.1", "0.19.2")
_MARK = "_miles_cpu_adapted"  # set on every replacement, so applying twice changes nothing


def megatron_core_version() -> str:
    import megatron.core

    # 0.19 appends "+<git HEAD>" when its files sit inside a git checkout (a venv in this repository): the release
    # is the part before it.
    return str(megatron.core.__version__).split("+")[0]


def check_version() -> None:
    """RuntimeError unless the installed megatron-core is one whose CPU adaptations are tested."""
    version = megatron_core_version()
    if version not in TESTED_MEGATRON_CORE:
        raise RuntimeError(
            f"megatron-core {version} is installed; its CPU adaptations (miles_runner/trainer/megatron/cpu_compat.py) "
            f"are tested on {', '.join(TESTED_MEGATRON_CORE)} only: install one of those, or test the adaptations "
            "on this version and add it to TESTED_MEGATRON_CORE"
        )


def target(module_name: str, attribute: str) -> Any:
    """``module.attribute`` as megatron-core defines it, or a RuntimeError saying which adaptation lost its target."""
    module = importlib.import_module(module_name)
    if not hasattr(module, attribute):
        raise RuntimeError(
            f"megatron-core {megatron_core_version()}: {module_name}.{attribute} no longer exists; the CPU adaptation "
            "that replaces it (miles_runner/trainer/megatron/cpu_compat.py) must be revised for this version"
        )
    return getattr(module, attribute)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def adapt_current_device() -> None:
    if not getattr(torch.cuda.current_device, _MARK, False):
        setattr(_cpu_current_device, _MARK, True)
        torch.cuda.current_device = _cpu_current_device


def _cpu_tracker_class(base: Any) -> type:  # megatron's class: untyped
    class CpuRNGStatesTracker(base):
        """megatron's RNG tracker with CPU generator states (the tensor-, data- and expert-parallel streams)."""

        _current_state_name: str  # megatron's attribute (the stream a fork is in): declared for the type checker

        def add(self, name: str, seed: int) -> None:
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            outer = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer, outer_name = torch.get_rng_state(), self._current_state_name
            if outer_name != "default-rng":
                self.states_[outer_name] = outer
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(self.states_[outer_name] if outer_name != "default-rng" else outer)
                self._current_state_name = outer_name

    setattr(CpuRNGStatesTracker, _MARK, True)
    return CpuRNGStatesTracker


def adapt_rng_tracker() -> None:
    random: Any = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random.CudaRNGStatesTracker, _MARK, False):
        return
    # initialize_rng_tracker builds its tracker from the class name it looks up at call time
    random.CudaRNGStatesTracker = _cpu_tracker_class(random.CudaRNGStatesTracker)
    random.initialize_rng_tracker(force_reset=True)


def adapt_sequence_parallel_norm() -> None:
    norm = importlib.import_module("megatron.core.transformer.torch_norm").WrappedTorchNorm
    original = norm.__new__
    if getattr(original, _MARK, False):
        return

    def build(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, **kwargs)
        plain = copy.copy(config)  # a shallow copy: __post_init__ (the config's validation) does not rerun
        plain.sequence_parallel = False
        module = original(cls, plain, hidden_size, eps, **kwargs)
        for parameter in module.parameters():
            parameter.sequence_parallel = True
        return module

    setattr(build, _MARK, True)
    norm.__new__ = build


def adapt_te_general_gemm() -> None:
    moe_utils: Any = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # what megatron-core means when Transformer Engine is absent


@dataclass(frozen=True)
class Adaptation:
    """One change, and the megatron-core (or torch) names it replaces or relies on, checked before it applies."""

    apply: Callable[[], None]
    targets: tuple[tuple[str, str], ...]  # (module, attribute)


ADAPTATIONS: tuple[Adaptation, ...] = (
    Adaptation(adapt_current_device, (("torch.cuda", "current_device"),)),
    Adaptation(
        adapt_rng_tracker,
        (
            ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker"),
            ("megatron.core.tensor_parallel.random", "initialize_rng_tracker"),
            ("megatron.core.tensor_parallel.random", "model_parallel_cuda_manual_seed"),
        ),
    ),
    Adaptation(adapt_sequence_parallel_norm, (("megatron.core.transformer.torch_norm", "WrappedTorchNorm"),)),
    # the router's gating function is what reads te_general_gemm
    Adaptation(adapt_te_general_gemm, (("megatron.core.transformer.moe.moe_utils", "RouterGatingLinearFunction"),)),
)


# What megatron-core warns about at import on a CPU build: the fallbacks this module exists for, expected here.
EXPECTED_CPU_WARNINGS = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"full scope is deprecated",  # TransformerConfig's own default cuda_graph_scope (0.16.1)
)


def quiet_expected_fallbacks() -> None:
    for message in EXPECTED_CPU_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def apply_cpu_adaptations() -> None:
    """Make megatron-core run on a CPU torch build; idempotent; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        return
    quiet_expected_fallbacks()
    check_version()
    for adaptation in ADAPTATIONS:
        for module, attribute in adaptation.targets:
            target(module, attribute)
        adaptation.apply()
