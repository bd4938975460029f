"""What Megatron-Bridge needs to import and run LoRA on a CPU-only machine (no Transformer Engine), as checked
stand-ins; megatron-core's own CPU adaptations are cpu_compat's.

Found on megatron-bridge 0.6.2 with megatron-core 0.19.2 (docs/development.md, "Megatron-Bridge on CPU"):

1. ``megatron.bridge.peft.lora_layers`` imports ``transformer_engine.pytorch`` unconditionally (for its fused TE
   LoRA, which only a GPU run with ``use_transformer_engine_op_fuser`` builds). A stand-in module is importable
   while that one module loads, and removed from ``sys.modules`` right after, so every other ``try: import
   transformer_engine`` still sees that Transformer Engine is absent.
2. megatron-core 0.19 defines its Transformer Engine class names (``TEColumnParallelLinear`` ...) as placeholders
   when Transformer Engine is absent, so Bridge's ``safe_import_from`` finds them and its ``HAVE_TE`` flags read
   True: LoRA would then treat megatron's local linears by TE rules. The flags are set False.

3. GLM-5's attention (MLA with a DSA indexer) has only a Transformer Engine spec in megatron-core 0.19
   (``dsa_local_block_spec`` builds it from megatron's local modules; bridge.cpu_overrides picks it for a DSA model).

Each stand-in first resolves what it replaces, so a Bridge release that moves it fails loudly here; Bridge
versions whose stand-ins were not tested are refused. Nothing is changed when CUDA is available.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch

from miles_runner.trainer.megatron.cpu_compat import apply_cpu_adaptations

TESTED_MEGATRON_BRIDGE = ("0.6.2",)
LORA_LAYERS = "megatron.bridge.peft.lora_layers"  # the module with the unconditional Transformer Engine import
LORA_LAYERS_FILE = ("peft", "lora_layers.py")  # its file in the megatron.bridge package
TE_PACKAGE = "transformer_engine"
# Bridge's modules whose HAVE_TE flag decides how LoRA treats a linear (peft/utils: adapter shapes and parallel
# modes; peft/module_matcher: which modules are targets).
TE_FLAG_MODULES = ("megatron.bridge.peft.utils", "megatron.bridge.peft.module_matcher")


def megatron_bridge_version() -> str:
    return importlib.metadata.version("megatron-bridge")


def check_version() -> None:
    """RuntimeError unless the installed megatron-bridge is one whose CPU stand-ins are tested."""
    version = megatron_bridge_version()
    if version not in TESTED_MEGATRON_BRIDGE:
        raise RuntimeError(
            f"megatron-bridge {version} is installed; its CPU stand-ins (miles_runner/trainer/megatron/"
            f"bridge_compat.py) are tested on {', '.join(TESTED_MEGATRON_BRIDGE)} only: install one of those, or "
            "test the stand-ins on this version and add it to TESTED_MEGATRON_BRIDGE"
        )


class _StandInModule(types.ModuleType):
    """A Transformer Engine namespace whose every name is a class nothing is an instance of (CamelCase) or a
    nested namespace (lowercase): enough for class bodies, annotations and isinstance checks to evaluate."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value: Any = type(name, (), {}) if name[:1].isupper() else _StandInModule(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


def _te_stand_in() -> dict[str, types.ModuleType]:
    package: Any = _StandInModule(TE_PACKAGE)
    package.__path__ = []  # a package, so `import transformer_engine.pytorch` resolves its submodule
    pytorch = _StandInModule(f"{TE_PACKAGE}.pytorch")
    package.pytorch = pytorch
    return {TE_PACKAGE: package, f"{TE_PACKAGE}.pytorch": pytorch}


class _LoadWithTEStandIn(importlib.abc.Loader):
    """Loads ``lora_layers`` with the Transformer Engine stand-in in ``sys.modules``, and takes it out after."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        stand_in = _te_stand_in()
        sys.modules.update(stand_in)
        try:
            self.loader.exec_module(module)
        finally:
            for name, stood_in in stand_in.items():
                if sys.modules.get(name) is stood_in:
                    del sys.modules[name]


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _LoadWithTEStandIn(spec.loader)
        return spec


def _transformer_engine_installed() -> bool:
    return importlib.util.find_spec(TE_PACKAGE) is not None


def _require_lora_layers_file() -> None:
    # Located without importing megatron.bridge (whose import would load lora_layers before the finder is in).
    bridge = importlib.util.find_spec("megatron.bridge")
    folders = list(bridge.submodule_search_locations or []) if bridge else []
    if not any(Path(folder).joinpath(*LORA_LAYERS_FILE).is_file() for folder in folders):
        raise RuntimeError(
            f"megatron-bridge {megatron_bridge_version()}: {LORA_LAYERS} no longer exists; the Transformer Engine "
            "stand-in (miles_runner/trainer/megatron/bridge_compat.py) must be revised for this version"
        )


def stand_in_for_lora_layers_te_import() -> None:
    """Stand-in 1 (before megatron.bridge is imported): lora_layers finds a Transformer Engine while it loads."""
    if LORA_LAYERS in sys.modules or _transformer_engine_installed():
        return
    _require_lora_layers_file()
    if not any(isinstance(finder, _LoraLayersFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())


def turn_off_te_flags() -> None:
    """Stand-in 2 (after the import): Bridge's HAVE_TE flags say what is true, that Transformer Engine is absent."""
    if _transformer_engine_installed():
        return
    for name in TE_FLAG_MODULES:
        module: Any = importlib.import_module(name)
        if not hasattr(module, "HAVE_TE"):
            raise RuntimeError(
                f"megatron-bridge {megatron_bridge_version()}: {name}.HAVE_TE no longer exists; the CPU stand-in "
                "that clears it (miles_runner/trainer/megatron/bridge_compat.py) must be revised for this version"
            )
        module.HAVE_TE = False


def apply_bridge_adaptations() -> None:
    """Make megatron-core and Megatron-Bridge's LoRA run on a CPU torch build; idempotent; a no-op with CUDA."""
    if torch.cuda.is_available():
        return
    apply_cpu_adaptations()
    check_version()
    stand_in_for_lora_layers_te_import()
    importlib.import_module("megatron.bridge")
    importlib.import_module(LORA_LAYERS)
    turn_off_te_flags()


# ---- GLM-5's attention (MLA with a DSA indexer) without Transformer Engine ----

DSA_VARIANT = "dsa"  # the provider's experimental_attention_variant for DeepSeek sparse attention (GLM-5)
# Bridge registers each megatron linear class by name with how its weights split over TP; the stand-in below is new.
REPLICATED = "replicated"


def uses_dsa(provider: Any) -> bool:
    return getattr(provider, "experimental_attention_variant", None) == DSA_VARIANT


def dsa_local_block_spec(config: Any) -> Any:
    """Stand-in 3: the decoder block of a DSA model (GLM-5) with megatron's local modules. Bridge's GLM-5 spec is
    megatron-core's experimental-attention block, which asserts Transformer Engine; this is megatron's local GPT
    block (its MLPs, MoE and norms) with each layer's attention swapped for megatron-core's own DSA attention
    (AbsorbedMLASelfAttention + DSAttention), built from the local backend with two changes:

    - the local backend has no ``linear()`` (Transformer Engine's replicated TELinear), which the DSA indexer's
      three projections take: ``_DuplicatedLinear`` is megatron's ColumnParallelLinear taking (and dropping) the
      ``parallel_mode`` argument TELinear has. It is replicated only at TP = 1 (``tensor_parallel_size`` must be 1).
    - the MLA down projections (linear_q_down_proj, linear_kv_down_proj) take ColumnParallelLinear, one of the
      classes AbsorbedMLASelfAttention accepts there besides TELinear.

    Measured on tiny-glm5 at TP = 1: the logits match transformers' within 5e-5 and LoRA on the five MLA linears
    exports a PEFT adapter that transformers applies with the same logits."""
    import copy

    from megatron.bridge.models.conversion.param_mapping import AutoMapping
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if config.tensor_model_parallel_size != 1:
        raise ValueError(
            "GLM-5's DSA attention is built on CPU (without Transformer Engine) at tensor parallel size 1 only: its "
            f"indexer's replicated linears stand in as column-parallel ones; got tp={config.tensor_model_parallel_size}"
        )

    class _DuplicatedLinear(ColumnParallelLinear):
        def __init__(self, *args: Any, parallel_mode: str | None = None, **kwargs: Any) -> None:
            kwargs.setdefault("gather_output", False)
            super().__init__(*args, **kwargs)

    class _LocalDSASpecProvider(LocalSpecProvider):
        def linear(self) -> type:
            return _DuplicatedLinear

    AutoMapping.register_module_type(_DuplicatedLinear.__name__, REPLICATED)
    plain = copy.copy(config)  # megatron's GPT block refuses an experimental attention variant
    plain.experimental_attention_variant = None
    block = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization="RMSNorm")
    attention = get_dsa_module_spec_for_backend(config, backend=_LocalDSASpecProvider())
    attention.submodules.linear_q_down_proj = ColumnParallelLinear
    attention.submodules.linear_kv_down_proj = ColumnParallelLinear
    for layer in block.layer_specs:
        layer.submodules.self_attention = attention
    return block


def honour_attention_masks(model: torch.nn.Module) -> int:
    """Make every DSA attention of `model` apply the attention mask it is given; returns how many it changed.

    megatron-core's DSAttention masks plain-causally whenever its layer spec says ``causal`` (what GLM-5's does),
    and then ignores the mask: right only for one sample per row. The trainer packs several samples into a row
    (qkv_format thd, megatron/packing.py) and gives the block mask that keeps each sample to its own earlier tokens;
    without this the second sample of a row would read the first (measured on tiny-glm5: logits off by 3.8). With
    no mask type, DSAttention builds its masks, the indexer's included, from the given mask."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAttention

    changed = 0
    for module in model.modules():
        if isinstance(module, DSAttention):
            module.forward = functools.partial(_with_given_mask, module.forward)
            changed += 1
    return changed


def _with_given_mask(forward: Any, *args: Any, **kwargs: Any) -> Any:
    if kwargs.get("attention_mask") is not None:
        kwargs["attn_mask_type"] = None
    return forward(*args, **kwargs)
