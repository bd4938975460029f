"""The raw LoRA (raw_lora.py) in PEFT names and back: what engines load, checkpoints hold and adapters.init_path
gives, the same tensors whatever the TP/EP/SP layout.

Names are peft's for the HF model of the same checkpoint (``lora_model.peft_adapter_state`` gives the same for the
FSDP trainer): ``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight`` ... A fused megatron LoRA is
split into its HF modules: q/k/v (``linear_qkv``) and gate/up (``linear_fc1``) share lora_A, and lora_B's rows
are split (the per-query-group interleave of linear_qkv; the gate and up halves of linear_fc1). That is exactly a
peft adapter whose grouped modules have equal lora_A, so peft and the engines compute the same outputs.

MoE experts: transformers 5 stores a Qwen3-MoE layer's experts as fused 3-D parameters (``mlp.experts.gate_up_proj``
[E, 2I, H] with gate rows first, ``mlp.experts.down_proj`` [E, H, I]); peft 0.21 targets them with
``target_parameters`` (lora.ParamWrapper), whose tensors stack the experts: lora_A [E*r, in] (expert e's rows
e*r..e*r+r-1) and lora_B [out, r*E] (column k*E + e is expert e's k-th column). When a layer's experts carry both
adapters, peft nests the wrappers: gate_up_proj's live under ``mlp.experts.base_layer``, down_proj's under
``mlp.experts``. The embedded engine loads these through peft (model_runner: ParamWrapper adapters run in their
own pass). ``peft_adapter_config`` writes the matching config (expert targets as ``target_parameters``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from miles_runner.core.adapters import AdapterSpec
from miles_runner.trainer import lora_model
from miles_runner.trainer.megatron.convert import fuse_rows, hf_names, split_fused_rows
from miles_runner.trainer.megatron.raw_lora import LoRASite, ParallelLoRA, lora_modules

PREFIX = "base_model.model."  # peft's prefix before the HF model's own module names
_EXPERT_PARAMETER = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}


# ---- naming ----


def _dense_modules(site: LoRASite) -> list[str]:
    """The PEFT module names of a dense LoRA, in megatron's fused row order (q, k, v; gate, up)."""
    return [PREFIX + name for name in hf_names(site.megatron_name)]


def _split_b(site: LoRASite, full_b: torch.Tensor, hf_config: dict[str, Any]) -> list[torch.Tensor]:
    return list(split_fused_rows(site.megatron_name, full_b, hf_config).values())


def _expert_module(layer: int, module: str, layer_modules: set[str]) -> str:
    nested = module == "linear_fc1" and "linear_fc2" in layer_modules  # peft wraps gate_up_proj first
    return f"{PREFIX}model.layers.{layer}.mlp.experts" + (".base_layer" if nested else "")


# ---- export ----


def export_peft_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA tensor, full, in PEFT names, on every rank (collective over TP and EP)."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], list[ParallelLoRA]] = {}
    for lora in lora_modules(model):
        if lora.site.expert is not None:
            experts.setdefault((lora.site.layer, lora.site.module), []).append(lora)
            continue
        full_a, full_b = lora.full_a(), lora.full_b()
        for module, rows in zip(_dense_modules(lora.site), _split_b(lora.site, full_b, model.hf_config), strict=True):
            state[f"{module}.lora_A.weight"] = full_a.clone()
            state[f"{module}.lora_B.weight"] = rows.contiguous()
    for (layer, module), loras in experts.items():
        a, b = _gather_experts(loras)
        layer_modules = {m for (lay, m) in experts if lay == layer}
        name = _expert_module(layer, module, layer_modules)
        state[f"{name}.lora_A.weight"] = a.reshape(-1, a.shape[-1]).contiguous()
        state[f"{name}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()
    return state


def _gather_experts(loras: list[ParallelLoRA]) -> tuple[torch.Tensor, torch.Tensor]:
    """All experts' A [E, r, in] and B [E, out, r] in global expert order (collective over EP)."""
    from megatron.core import parallel_state

    a = torch.stack([lora.full_a() for lora in loras])
    b = torch.stack([lora.full_b() for lora in loras])
    ids = torch.tensor([lora.site.expert for lora in loras])
    group = parallel_state.get_expert_model_parallel_group()
    if group.size() > 1:
        a, b, ids = (torch.cat(_gather(t, group)) for t in (a, b, ids))
    order = torch.argsort(ids)
    return a[order], b[order]


def _gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def peft_adapter_config(model: torch.nn.Module, adapter: AdapterSpec) -> dict[str, Any]:
    """The adapter_config for ``export_peft_state``'s tensors (what engines and peft load with them): expert LoRA
    appears as peft ``target_parameters``; without experts it is ``lora_model.adapter_config_dict``."""
    config = lora_model.adapter_config_dict(adapter)
    loras = lora_modules(model)
    dense = {m.rsplit(".", 1)[1] for lora in loras if lora.site.expert is None for m in _dense_modules(lora.site)}
    expert = sorted({f"mlp.experts.{_EXPERT_PARAMETER[lo.site.module]}" for lo in loras if lo.site.expert is not None})
    if expert:
        config["target_modules"] = [name for name in adapter.target_modules if name in dense]
        config["target_parameters"] = expert
        config["lora_dropout"] = 0.0  # peft's ParamWrapper refuses dropout; engines only run inference anyway
    return config


# ---- load ----


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The PEFT names and full shapes ``export_peft_state`` gives for this model (no collectives)."""
    from megatron.core import parallel_state

    shapes: dict[str, tuple[int, ...]] = {}
    experts: dict[tuple[int, str], ParallelLoRA] = {}
    for lora in lora_modules(model):
        if lora.site.expert is not None:
            experts[(lora.site.layer, lora.site.module)] = lora
            continue
        parts = _split_b(lora.site, torch.empty(lora.out_features, lora.rank), model.hf_config)
        for module, rows in zip(_dense_modules(lora.site), parts, strict=True):
            shapes[f"{module}.lora_A.weight"] = (lora.rank, lora.in_features)
            shapes[f"{module}.lora_B.weight"] = tuple(rows.shape)
    ep = parallel_state.get_expert_model_parallel_world_size()
    for (layer, module), lora in experts.items():
        total = ep * sum(1 for x in lora_modules(model) if (x.site.layer, x.site.module) == (layer, module))
        name = _expert_module(layer, module, {m for (lay, m) in experts if lay == layer})
        shapes[f"{name}.lora_A.weight"] = (total * lora.rank, lora.in_features)
        shapes[f"{name}.lora_B.weight"] = (lora.out_features, lora.rank * total)
    return shapes


def check_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Refuse a state that is not exactly this model's adapter, naming the first wrong tensor."""
    expected = expected_shapes(model)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        raise ValueError(
            f"adapter state lacks {missing[0]} (and {len(missing) - 1} more) that this model's LoRA "
            f"(rank, targets) needs"
        )
    if unexpected:
        raise ValueError(
            f"adapter state has {unexpected[0]} (and {len(unexpected) - 1} more), which this model's "
            "LoRA does not have: a different target_modules or model"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ValueError(
                f"adapter tensor {name} has shape {tuple(state[name].shape)}, this model's LoRA needs "
                f"{shape}: a different rank or model"
            )


def load_peft_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set every LoRA from PEFT-named full tensors (the inverse of ``export_peft_state``); strict: a state that
    does not fit is refused before any LoRA changes."""
    check_state(model, state)
    loras = lora_modules(model)
    layer_expert_modules = {(x.site.layer, x.site.module) for x in loras if x.site.expert is not None}
    fulls = []
    for lora in loras:
        if lora.site.expert is None:
            fulls.append(_dense_full(lora, model.hf_config, state))
            continue
        layer_modules = {m for (lay, m) in layer_expert_modules if lay == lora.site.layer}
        name = _expert_module(lora.site.layer, lora.site.module, layer_modules)
        stacked_a, stacked_b = state[f"{name}.lora_A.weight"], state[f"{name}.lora_B.weight"]
        experts = stacked_a.shape[0] // lora.rank
        full_a = stacked_a.reshape(experts, lora.rank, -1)[lora.site.expert]
        fulls.append((full_a, stacked_b.reshape(stacked_b.shape[0], lora.rank, experts)[:, :, lora.site.expert]))
    for lora, (full_a, full_b) in zip(loras, fulls, strict=True):
        lora.load_full(full_a, full_b)


def _dense_full(lora: ParallelLoRA, hf_config: dict, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    modules = _dense_modules(lora.site)
    full_a = state[f"{modules[0]}.lora_A.weight"]
    for module in modules[1:]:
        if not torch.equal(state[f"{module}.lora_A.weight"], full_a):
            raise ValueError(
                f"adapter tensor {module}.lora_A.weight differs from {modules[0]}.lora_A.weight: "
                f"megatron fuses them into {lora.site.module}, whose LoRA has one A"
            )
    parts = {m[len(PREFIX) :]: state[f"{m}.lora_B.weight"] for m in modules}
    return full_a, fuse_rows(lora.site.megatron_name, parts, hf_config)
