"""HF <-> megatron-core weights for the supported architectures, sharded by TP/EP when loading, gathered when
exporting.

Every megatron parameter has one HF source (a copy), or several fused into it:

- ``linear_qkv`` (weight, and bias for qwen2) holds q, k and v interleaved per query group: for each KV head g,
  the rows of the query heads it serves, then its k rows, then its v rows. A TP shard is a run of whole groups.
- ``linear_fc1`` (dense MLP and each expert) holds gate then up; a TP shard is ``[gate shard; up shard]``, so the
  halves are split per shard, not over the whole tensor.
- the word embedding and the output layer hold the vocabulary padded to a multiple of TP (model.padded_vocab_size).

Experts are numbered globally in HF (``mlp.experts.<e>``) and locally in megatron (``local_experts.<j>`` on EP rank
r is expert ``r * local + j``); expert weights shard over the expert-tensor-parallel group, the rest over TP.
Export runs collectives on the TP, expert-TP and EP groups, so every rank calls it and every rank gets the full
HF state, bit-exact to the checkpoint it was loaded from.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from miles_runner.trainer.megatron.model import MegatronCausalLM, check_model_type, head_dim, moe_layers, num_experts

_LOCAL_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")

# megatron module -> its HF modules, in fused row order (the LoRA export composes full names from these)
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}


@dataclass(frozen=True)
class Converter:
    """What differs between the supported architectures' weights."""

    model_type: str
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, qwen3_moe
    moe: bool = False  # qwen3_moe: router + per-expert MLPs on the MoE layers


CONVERTERS: dict[str, Converter] = {
    "qwen3_moe": Converter("qwen3_moe", qk_norm=True, moe=True),
    "qwen3": Converter("qwen3", qk_norm=True),
    "qwen2": Converter("qwen2", qkv_bias=True),
}


def converter(hf_config: dict) -> Converter:
    return CONVERTERS[check_model_type(hf_config)]


def hf_module_names(model_type: str) -> dict[str, tuple[str, ...]]:
    """megatron linear module suffix -> the HF module names it fuses (experts: the same, per expert)."""
    check_model_type({"model_type": model_type})
    return dict(FUSED_MODULES)


def _hf_layer_module(megatron_module: str) -> str:
    """``decoder.layers.3.self_attention`` -> ``model.layers.3.self_attn``; ``...mlp.experts.local_experts.5`` (a
    global expert index) -> ``...mlp.experts.5``."""
    name = _LAYER.sub(r"model.layers.\1.", megatron_module)
    return name.replace(".self_attention", ".self_attn").replace(".experts.local_experts.", ".experts.")


def _module_and_leaf(megatron_name: str) -> tuple[str, str]:
    """``a.linear_qkv.weight`` -> (``a.linear_qkv``, ``.weight``); a module name -> (it, "")."""
    for leaf in (".weight", ".bias"):
        if megatron_name.endswith(leaf):
            return megatron_name[: -len(leaf)], leaf
    return megatron_name, ""


def hf_names(megatron_name: str) -> list[str]:
    """The HF names of a megatron linear module or its weight/bias (global expert numbering), in fused row order:
    ``decoder.layers.0.self_attention.linear_qkv.weight`` -> ``[model.layers.0.self_attn.q_proj.weight, ...k_proj...,
    ...v_proj...]``."""
    module, leaf = _module_and_leaf(megatron_name)
    parent, _, linear = module.rpartition(".")
    if linear not in FUSED_MODULES:
        raise ValueError(f"{megatron_name!r} is not one of megatron's linears {sorted(FUSED_MODULES)}")
    return [f"{_hf_layer_module(parent)}.{hf}{leaf}" for hf in FUSED_MODULES[linear]]


def _qkv_sizes(hf_config: dict) -> tuple[int, int, int]:
    """(query groups, query rows per group, rows per k or v head)."""
    groups = int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])
    dim = head_dim(hf_config)
    return groups, hf_config["num_attention_heads"] // groups * dim, dim


def split_fused_rows(megatron_name: str, weight: Tensor, hf_config: dict) -> dict[str, Tensor]:
    """A full (unsharded) megatron linear weight/bias, or any tensor with its rows (a LoRA B), split into its HF
    parts by row: linear_qkv per query group into q, k, v; linear_fc1 into gate, up; the others unchanged."""
    names = hf_names(megatron_name)
    linear = _module_and_leaf(megatron_name)[0].rpartition(".")[2]
    if linear == "linear_qkv":
        groups, q_rows, kv_rows = _qkv_sizes(hf_config)
        per_group = weight.reshape(groups, q_rows + 2 * kv_rows, *weight.shape[1:])
        parts = per_group.split([q_rows, kv_rows, kv_rows], dim=1)
        return {name: part.reshape(-1, *weight.shape[1:]) for name, part in zip(names, parts, strict=True)}
    if linear == "linear_fc1":
        return dict(zip(names, weight.chunk(2, dim=0), strict=True))
    return {names[0]: weight}


def fuse_rows(megatron_name: str, parts: dict[str, Tensor], hf_config: dict) -> Tensor:
    """The inverse of split_fused_rows: HF parts (keyed by their HF names) into megatron's fused row order."""
    names = hf_names(megatron_name)
    missing = [name for name in names if name not in parts]
    if missing:
        raise KeyError(f"{megatron_name}: missing HF tensors {missing}")
    tensors = [parts[name] for name in names]
    if len(names) == 3:  # linear_qkv
        groups = _qkv_sizes(hf_config)[0]
        rest = tensors[0].shape[1:]
        grouped = [t.reshape(groups, -1, *rest) for t in tensors]
        return torch.cat(grouped, dim=1).reshape(-1, *rest)
    return torch.cat(tensors, dim=0)


def _is_gate_up(megatron_name: str) -> bool:
    return ".linear_fc1." in megatron_name


def shard(megatron_name: str, full: Tensor, rank: int, size: int, dim: int) -> Tensor:
    """This rank's shard of a full megatron tensor split ``size`` ways along ``dim`` (linear_fc1: gate and up halves
    split separately, as megatron's column-parallel SwiGLU holds them)."""
    if size == 1:
        return full
    if _is_gate_up(megatron_name) and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    return full.chunk(size, dim=dim)[rank]


def unshard(megatron_name: str, shards: list[Tensor], dim: int) -> Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of shard)."""
    if len(shards) == 1:
        return shards[0]
    if _is_gate_up(megatron_name) and dim == 0:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)


@dataclass(frozen=True)
class _Placement:
    """Where a local megatron parameter sits: its global name and the group it is split over."""

    global_name: str
    rank: int  # in the split group
    size: int
    dim: int | None  # None: replicated
    expert: bool


def _placement(model: MegatronCausalLM, local_name: str, parameter: Tensor) -> _Placement:
    from megatron.core import parallel_state as ps

    match = _LOCAL_EXPERT.search(local_name)
    if match is None:
        rank, size, expert, name = ps.get_tensor_model_parallel_rank(), model.layout.tp, False, local_name
    else:
        local_count = num_experts(model.hf_config) // model.layout.ep
        index = ps.get_expert_model_parallel_rank() * local_count + int(match.group(1))
        name = _LOCAL_EXPERT.sub(f".local_experts.{index}.", local_name)
        rank, size, expert = ps.get_expert_tensor_parallel_rank(), model.layout.etp, True
    split = getattr(parameter, "tensor_model_parallel", False) and size > 1
    return _Placement(name, rank, size, parameter.partition_dim if split else None, expert)


def _hf_sources(name: str, hf_config: dict) -> list[str]:
    """The HF tensors a (global) megatron parameter is made of."""
    fixed = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    if name in fixed:
        return [fixed[name]]
    layer_norms = {
        "input_layernorm": "input_layernorm",
        "pre_mlp_layernorm": "post_attention_layernorm",
        "self_attention.q_layernorm": "self_attn.q_norm",
        "self_attention.k_layernorm": "self_attn.k_norm",
        "mlp.router": "mlp.gate",
    }
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"no HF counterpart known for megatron parameter {name!r}")
    module, leaf = name[match.end() :].rsplit(".", 1)
    if module in layer_norms:
        return [f"model.layers.{match.group(1)}.{layer_norms[module]}.{leaf}"]
    return hf_names(name)


def megatron_names(hf_config: dict) -> Iterator[str]:
    """Every global megatron parameter name of the model (all experts), in the model's order."""
    conv = converter(hf_config)
    yield "embedding.word_embeddings.weight"
    routed = set(moe_layers(hf_config))
    for i in range(hf_config["num_hidden_layers"]):
        layer = f"decoder.layers.{i}"
        yield f"{layer}.input_layernorm.weight"
        yield f"{layer}.self_attention.linear_qkv.weight"
        if conv.qkv_bias:
            yield f"{layer}.self_attention.linear_qkv.bias"
        if conv.qk_norm:
            yield f"{layer}.self_attention.q_layernorm.weight"
            yield f"{layer}.self_attention.k_layernorm.weight"
        yield f"{layer}.self_attention.linear_proj.weight"
        yield f"{layer}.pre_mlp_layernorm.weight"
        if i in routed:
            yield f"{layer}.mlp.router.weight"
            for e in range(num_experts(hf_config)):
                yield f"{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"
                yield f"{layer}.mlp.experts.local_experts.{e}.linear_fc2.weight"
        else:
            yield f"{layer}.mlp.linear_fc1.weight"
            yield f"{layer}.mlp.linear_fc2.weight"
    yield "decoder.final_layernorm.weight"
    if not hf_config.get("tie_word_embeddings", False):
        yield "output_layer.weight"


def _is_vocab(name: str) -> bool:
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def megatron_tensor(name: str, hf_state: dict[str, Tensor], hf_config: dict, padded_vocab: int) -> Tensor:
    """The full (unsharded) megatron tensor ``name`` from HF tensors."""
    sources = _hf_sources(name, hf_config)
    if len(sources) > 1:
        return fuse_rows(name, {source: hf_state[source] for source in sources}, hf_config)
    tensor = hf_state[sources[0]]
    if _is_vocab(name) and padded_vocab > tensor.shape[0]:
        tensor = torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])])
    return tensor


def hf_tensors(name: str, full: Tensor, hf_config: dict) -> dict[str, Tensor]:
    """The HF tensors of a full megatron tensor (the inverse of megatron_tensor)."""
    sources = _hf_sources(name, hf_config)
    if len(sources) > 1:
        return split_fused_rows(name, full, hf_config)
    if _is_vocab(name):
        full = full[: hf_config["vocab_size"]]
    return {sources[0]: full}


class _LazyHF(dict):
    """HF checkpoint tensors read on first use from the folder's safetensors file(s)."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        from safetensors import safe_open

        index = folder / "model.safetensors.index.json"
        files = (
            sorted(set(json.loads(index.read_text())["weight_map"].values()))
            if index.is_file()
            else ["model.safetensors"]
        )
        self.handles = {}
        for file in files:
            handle = safe_open(str(folder / file), "pt")
            self.handles.update({key: handle for key in handle.keys()})  # noqa: SIM118 (a safetensors handle)

    def __missing__(self, key: str) -> Tensor:
        if key not in self.handles:
            raise KeyError(key)
        return self.handles[key].get_tensor(key)


def load_hf_checkpoint(model: MegatronCausalLM, folder: str | Path) -> None:
    """Load an HF checkpoint folder into this rank's shard of the model (every rank reads what it holds)."""
    from miles_runner.trainer.megatron.model import padded_vocab_size

    hf = _LazyHF(Path(folder))
    padded = padded_vocab_size(model.hf_config, model.layout)
    with torch.no_grad():
        for local_name, parameter in model.gpt.named_parameters():
            place = _placement(model, local_name, parameter)
            try:
                full = megatron_tensor(place.global_name, hf, model.hf_config, padded)
            except KeyError as missing:
                raise ValueError(f"{folder}: no tensor {missing} in the checkpoint (for {place.global_name})") from None
            local = full if place.dim is None else shard(place.global_name, full, place.rank, place.size, place.dim)
            if local.shape != parameter.shape:
                raise ValueError(
                    f"{folder}: {place.global_name} shard has shape {tuple(local.shape)}, the model "
                    f"expects {tuple(parameter.shape)}"
                )
            parameter.copy_(local)
    expected = {source for name in megatron_names(model.hf_config) for source in _hf_sources(name, model.hf_config)}
    unused = set(hf.handles) - expected - {"lm_head.weight"}  # a tied model's checkpoint may still carry lm_head
    if unused:
        raise ValueError(
            f"{folder}: tensors the megatron {model.hf_config['model_type']} model has no place for: "
            f"{sorted(unused)[:5]}"
        )


def _gather(tensor: Tensor, group, size: int) -> list[Tensor]:
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def export_hf_state(model: MegatronCausalLM) -> dict[str, Tensor]:
    """The full HF state dict of the model, on every rank (a collective: every rank of the model calls it)."""
    from megatron.core import parallel_state as ps

    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for local_name, parameter in model.gpt.named_parameters():
            place = _placement(model, local_name, parameter)
            tensor = parameter.detach()
            if place.dim is not None:
                group = ps.get_expert_tensor_parallel_group() if place.expert else ps.get_tensor_model_parallel_group()
                tensor = unshard(place.global_name, _gather(tensor, group, place.size), place.dim)
            if place.expert and model.layout.ep > 1:
                _export_experts(model, place.global_name, tensor, out)
                continue
            out.update({k: v.clone() for k, v in hf_tensors(place.global_name, tensor, model.hf_config).items()})
    return out


def _export_experts(model: MegatronCausalLM, name: str, tensor: Tensor, out: dict[str, Tensor]) -> None:
    """Gather one local expert's full tensor from every EP rank (the same local index there) into ``out``."""
    from megatron.core import parallel_state as ps

    local_count = num_experts(model.hf_config) // model.layout.ep
    local = _LOCAL_EXPERT.search(name)
    if local is None:
        raise ValueError(f"{name} is not a local expert's parameter")
    index = int(local.group(1)) % local_count
    for ep_rank, full in enumerate(_gather(tensor, ps.get_expert_model_parallel_group(), model.layout.ep)):
        global_name = _LOCAL_EXPERT.sub(f".local_experts.{ep_rank * local_count + index}.", name)
        out.update(hf_tensors(global_name, full, model.hf_config))
