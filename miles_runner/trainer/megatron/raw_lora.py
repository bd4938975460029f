"""lora_mode=raw: the project's own LoRA on megatron-core's tensor-parallel linears, sharded like the base.

A target linear keeps its weights; a forward hook adds ``scaling * B(A(dropout(x)))`` to its output
(``scaling = alpha / r``). HF target names map onto megatron modules (``HF_TO_MEGATRON``): q/k/v share one LoRA on
``linear_qkv`` and gate/up one on ``linear_fc1`` (``FUSED_GROUPS``: a target set naming part of a group is refused).
On a MoE layer gate/up/down target every expert's ``linear_fc1``/``linear_fc2`` (SequentialMLP local experts).
The LoRA modules live in ``model.lora_adapters`` (beside ``model.gpt``, whose parameters stay the checkpoint's, so
convert.py's HF export is unaffected); ``attach_lora`` freezes everything else.

Sharding, for a layer whose TP group has size tp (``base.tp_group``):
- column-parallel base (``linear_qkv``, ``linear_fc1``): A (r x in) replicated, B (out/tp x r) sharded by output.
  The LoRA input passes the same region as the base's input: ``copy_to_tensor_model_parallel_region`` (forward
  identity, backward all-reduce) or, under sequence parallelism, ``gather_from_sequence_parallel_region`` (forward
  all-gather of the sequence, backward reduce-scatter). So the input gradient is exact, and each rank's A gradient
  is the part that flows through its own B rows: A's gradient is a *partial sum over TP*.
- row-parallel base (``linear_proj``, ``linear_fc2``): A (r x in/tp) sharded by input, B (out x r) replicated.
  ``A x`` is a partial sum over TP, completed like the base output: ``reduce_from_tensor_model_parallel_region``
  (all-reduce; backward identity) or, under SP, ``reduce_scatter_to_sequence_parallel_region`` (each rank keeps its
  sequence shard; backward all-gather). Without SP B's gradient is complete on every rank; under SP each rank only
  saw its sequence shard, so B's gradient is a *partial sum over TP*.
- experts (expert-tensor-parallel size 1): plain per-expert matmuls; the token dispatcher moves the tokens.
``reduce_lora_grads`` all-reduces the TP partial sums (``lora_tp_partial`` on the parameter), then reduces over
data parallelism as megatron's DDP does: every gradient is divided by the data-parallel size (each rank's loss is
its share of the mean) and summed over the ranks holding the same weights -- the data-parallel group for dense
LoRA, the expert-data-parallel group for expert LoRA (an expert's gradient already holds the tokens the dispatcher
brought from the other EP ranks, so averaging over the expert-DP group alone would be wrong when EP > 1).

Dropout (``adapter.dropout``) draws from torch's default generator on a column-parallel input (replicated over TP,
so the TP ranks, seeded alike by megatron, draw the same mask) and from megatron's model-parallel RNG tracker on a
row-parallel input (sharded, so each rank its own mask), as megatron's own dropouts do.

Initialisation is layout-free: each LoRA draws its FULL A (kaiming-uniform, a=sqrt(5), as peft does) from a
generator seeded with ``seed`` and the LoRA's global name, and takes its local shard; B starts at zero. So the
same seed gives the same adapter at any TP/EP/SP, and ``lora_export`` gathers the same tensors back.

Multi-LoRA slots (``attach_slot``): several adapters, each with its own rank, alpha and targets, in
``model.lora_slots`` (one ModuleDict per engine slot). One hook per targeted linear applies the *active* slot's
LoRA only (``activate_slot``), so a forward trains one tenant and the others' parameters get no gradient. While a
slot is active, ``lora_modules`` is that slot's LoRAs, so export, load, gradient reduction and clipping act on it
alone, as Megatron-Bridge's ``expose_adapter_slot`` does for its MultiLoRA.
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from miles_runner.core.adapters import AdapterSpec
from miles_runner.core.megatron_families import FUSED_TARGET_GROUPS
from miles_runner.trainer.megatron.convert import shard, unshard

# The HF projections each fused megatron linear holds (the plan's megatron-lora-fused-targets checks the same groups).
FUSED_GROUPS: dict[str, tuple[str, ...]] = dict(zip(("linear_qkv", "linear_fc1"), FUSED_TARGET_GROUPS, strict=True))
HF_TO_MEGATRON: dict[str, str] = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
    # MLA attention (DeepSeek, GLM-5): the low-rank query and key-value projections; only lora_mode=bridge builds
    # these models (attach_lora refuses them, and the plan's raw-lora-needs-converter refuses their families).
    "q_a_proj": "linear_q_down_proj",
    "q_b_proj": "linear_q_up_proj",
    "kv_a_proj_with_mqa": "linear_kv_down_proj",
    "kv_b_proj": "linear_kv_up_proj",
}
MLA_MODULES = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")
COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_DENSE = re.compile(r"^(self_attention\.(linear_qkv|linear_proj)|mlp\.(linear_fc1|linear_fc2))$")


@dataclass(frozen=True)
class LoRASite:
    """Where one LoRA sits, independent of the layout: the global layer, the megatron module, the global expert."""

    layer: int
    module: str  # linear_qkv, linear_proj, linear_fc1 or linear_fc2
    expert: int | None = None

    @property
    def megatron_name(self) -> str:
        """The module's name in a one-rank model (global layer and expert numbers), as convert.py names it."""
        if self.expert is not None:
            return f"decoder.layers.{self.layer}.mlp.experts.local_experts.{self.expert}.{self.module}"
        block = "self_attention" if self.module in ("linear_qkv", "linear_proj") else "mlp"
        return f"decoder.layers.{self.layer}.{block}.{self.module}"


def megatron_targets(target_modules: list[str]) -> set[str]:
    """The megatron modules an HF target list names; unknown names and partial fused groups are refused."""
    unknown = sorted(set(target_modules) - set(HF_TO_MEGATRON))
    if unknown:
        raise ValueError(
            f"adapter.target_modules {unknown} have no megatron LoRA target (lora_mode=raw and "
            f"bridge map the same names; supported: {sorted(HF_TO_MEGATRON)})"
        )
    for module, group in FUSED_GROUPS.items():
        named = [name for name in group if name in target_modules]
        if named and len(named) != len(group):
            raise ValueError(
                f"adapter.target_modules names {named} but not all of {list(group)}: megatron fuses "
                f"them into {module}, whose LoRA covers the whole group; list all or none"
            )
    return {HF_TO_MEGATRON[name] for name in target_modules}


class ParallelLoRA(torch.nn.Module):
    """The LoRA of one megatron parallel linear: local A/B shards, the hook's computation, the init."""

    def __init__(self, base: torch.nn.Module, site: LoRASite, adapter: AdapterSpec, seed: int) -> None:
        super().__init__()
        self.site, self.rank = site, adapter.rank
        self.scaling = adapter.alpha / adapter.rank
        self.dropout = adapter.dropout
        self.column = site.module in COLUMN_PARALLEL
        self._weight_name = f"{site.megatron_name}.weight"  # convert.shard/unshard: fc1 holds gate and up halves
        self.tp_group = base.tp_group
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        if site.expert is not None and self.tp_size > 1:
            raise ValueError(
                f"{site.megatron_name}: expert LoRA with expert_tensor_parallel_size {self.tp_size} > 1 "
                "is not supported by lora_mode=raw; use trainer.parallel.etp=1"
            )
        self.communicates = self.tp_size > 1 and not base.explicit_expert_comm
        self.sequence_parallel = self.communicates and bool(base.sequence_parallel)
        self.in_features, self.out_features = base.input_size, base.output_size
        self.enabled = True
        full_a, full_b = self.initial_weights(seed)
        self.lora_A = torch.nn.Parameter(self.shard_a(full_a))
        self.lora_B = torch.nn.Parameter(self.shard_b(full_b))
        # Which gradients are partial sums over the TP group (see the module docstring).
        self.lora_A.lora_tp_partial = self.communicates and self.column
        self.lora_B.lora_tp_partial = self.sequence_parallel and not self.column
        for param in (self.lora_A, self.lora_B):
            param.lora_is_expert = site.expert is not None

    def initial_weights(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(self.site.megatron_name.encode()))
        full_a = torch.empty(self.rank, self.in_features)
        torch.nn.init.kaiming_uniform_(full_a, a=math.sqrt(5), generator=generator)
        return full_a, torch.zeros(self.out_features, self.rank)

    # ---- layout: full (TP=1 megatron layout) <-> this rank's shard ----

    def shard_a(self, full: torch.Tensor) -> torch.Tensor:
        if self.column or not self.communicates:
            return full.clone()
        return shard(self._weight_name, full, self.tp_rank, self.tp_size, dim=1).clone()

    def shard_b(self, full: torch.Tensor) -> torch.Tensor:
        if not self.column or not self.communicates:
            return full.clone()
        return shard(self._weight_name, full, self.tp_rank, self.tp_size, dim=0).clone()

    def full_a(self) -> torch.Tensor:
        """The full A (collective over TP for a row-parallel base)."""
        local = self.lora_A.detach()
        if self.column or not self.communicates:
            return local.clone()
        return unshard(self._weight_name, _all_gather(local, self.tp_group), dim=1)

    def full_b(self) -> torch.Tensor:
        """The full B in the one-rank megatron row order (collective over TP for a column-parallel base)."""
        local = self.lora_B.detach()
        if not self.column or not self.communicates:
            return local.clone()
        return unshard(self._weight_name, _all_gather(local, self.tp_group), dim=0)

    def load_full(self, full_a: torch.Tensor, full_b: torch.Tensor) -> None:
        with torch.no_grad():
            self.lora_A.copy_(self.shard_a(full_a.to(self.lora_A.dtype)))
            self.lora_B.copy_(self.shard_b(full_b.to(self.lora_B.dtype)))

    # ---- forward ----

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if self.column:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, group=self.tp_group)
            elif self.communicates:
                x = mappings.copy_to_tensor_model_parallel_region(x, group=self.tp_group)
            return F.linear(F.linear(self._dropout(x), self.lora_A), self.lora_B) * self.scaling
        hidden = F.linear(self._dropout(x, sharded=self.communicates), self.lora_A)
        if self.sequence_parallel:
            hidden = mappings.reduce_scatter_to_sequence_parallel_region(hidden, group=self.tp_group)
        elif self.communicates:
            hidden = mappings.reduce_from_tensor_model_parallel_region(hidden, group=self.tp_group)
        return F.linear(hidden, self.lora_B) * self.scaling

    def _dropout(self, x: torch.Tensor, *, sharded: bool = False) -> torch.Tensor:
        if self.dropout <= 0 or not self.training:
            return x
        if not sharded:
            return F.dropout(x, self.dropout)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout)


def _add_lora(lora: ParallelLoRA, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
    if not lora.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + lora.delta(x).to(out.dtype), bias


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


# ---- attaching ----


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(model.gpt.decoder.layers)


def _sites(model: torch.nn.Module, modules: set[str]) -> Iterator[tuple[str, torch.nn.Module, LoRASite]]:
    """(module name, module, site) of every linear the megatron targets name, in model order."""
    prefix = {id(m): n for n, m in model.named_modules()}
    for layer in _decoder_layers(model):
        global_layer = layer.layer_number - 1  # megatron numbers layers from 1, over the whole pipeline
        expert_ids = getattr(layer.mlp, "local_expert_indices", None)
        for name, module in layer.named_modules():
            expert = _EXPERT.match(name)
            if expert and expert.group(2) in modules:
                if expert_ids is None:
                    raise ValueError(f"layer {global_layer}'s MoE names no local_expert_indices for {name}")
                site = LoRASite(global_layer, expert.group(2), expert_ids[int(expert.group(1))])
            elif _DENSE.match(name) and name.rsplit(".", 1)[-1] in modules:
                site = LoRASite(global_layer, name.rsplit(".", 1)[-1])
            else:
                continue
            yield f"{prefix[id(layer)]}.{name}", module, site


def attach_lora(model: torch.nn.Module, adapter: AdapterSpec, *, seed: int) -> list[str]:
    """Freeze the base and put a LoRA on every targeted linear of a MegatronCausalLM; return their module names."""
    if lora_modules(model) or hasattr(model, "lora_slots"):
        raise ValueError("the model already has LoRA attached")
    for param in model.parameters():
        param.requires_grad_(False)
    loras = _new_loras(model, adapter, seed)
    for name, lora in loras.items():
        _module(model, name).register_forward_hook(functools.partial(_add_lora, lora), with_kwargs=True)
    model.lora_adapters = loras  # beside model.gpt, whose parameters stay the HF checkpoint's (convert.py)
    return [name.replace("__", ".") for name in loras]


def _new_loras(model: torch.nn.Module, adapter: AdapterSpec, seed: int) -> torch.nn.ModuleDict:
    """A LoRA on every linear the adapter targets, keyed by the linear's module name (dots as ``__``)."""
    modules = megatron_targets(list(adapter.target_modules))
    if mla := sorted(name for name in adapter.target_modules if HF_TO_MEGATRON[name] in MLA_MODULES):
        raise ValueError(
            f"adapter.target_modules {mla} are MLA projections: lora_mode=raw converts no MLA model; "
            "lora_mode=bridge builds them"
        )
    loras = torch.nn.ModuleDict()
    for name, module, site in _sites(model, modules):
        loras[name.replace(".", "__")] = ParallelLoRA(module, site, adapter, seed)
    if not loras:
        raise ValueError(f"adapter.target_modules {adapter.target_modules} matched no linear of the model")
    return loras


def _module(model: torch.nn.Module, key: str) -> torch.nn.Module:
    return model.get_submodule(key.replace("__", "."))


# ---- multi-LoRA slots ----


class SlotTable(torch.nn.ModuleDict):
    """``model.lora_slots``: each slot's LoRAs (a ModuleDict keyed like ``lora_adapters``) and the active slot."""

    def __init__(self) -> None:
        super().__init__()
        self.active: int | None = None
        self.hooked: set[str] = set()  # the linears whose hook applies the active slot's LoRA

    def active_loras(self) -> torch.nn.ModuleDict | None:
        return None if self.active is None else self[str(self.active)]


def attach_slot(model: torch.nn.Module, slot: int, adapter: AdapterSpec, *, seed: int) -> list[ParallelLoRA]:
    """Put slot `slot`'s LoRA (fresh: A from `seed`, B zero) on every linear the adapter targets; the base stays
    frozen. Returns the slot's LoRAs in model order."""
    if lora_modules(model) and not hasattr(model, "lora_slots"):
        raise ValueError("the model carries a single LoRA (attach_lora); slots need a model without one")
    if not hasattr(model, "lora_slots"):
        for param in model.parameters():
            param.requires_grad_(False)
        model.lora_slots = SlotTable()
    table: SlotTable = model.lora_slots
    if str(slot) in table:
        raise ValueError(f"LoRA slot {slot} is taken; clear it first")
    loras = _new_loras(model, adapter, seed)
    for key in loras:
        if key not in table.hooked:
            _module(model, key).register_forward_hook(functools.partial(_add_slot_lora, table, key), with_kwargs=True)
            table.hooked.add(key)
    table[str(slot)] = loras
    return list(loras.values())


def clear_slot(model: torch.nn.Module, slot: int) -> None:
    """Drop slot `slot`'s LoRA (its hooks stay, applying nothing while no LoRA of theirs is active)."""
    table: SlotTable = model.lora_slots
    if table.active == slot:
        table.active = None
    del table[str(slot)]


@contextlib.contextmanager
def slot_active(model: torch.nn.Module, slot: int) -> Iterator[None]:
    """Within: slot `slot`'s LoRA is the one forwards apply and the one ``lora_modules`` names."""
    table: SlotTable = model.lora_slots
    if str(slot) not in table:
        raise ValueError(f"LoRA slot {slot} holds no adapter")
    before, table.active = table.active, slot
    try:
        yield
    finally:
        table.active = before


def _add_slot_lora(table: SlotTable, key: str, module: torch.nn.Module, args: tuple, kwargs: dict, output: tuple):
    loras = table.active_loras()
    if loras is None or key not in loras:
        return output
    return _add_lora(loras[key], module, args, kwargs, output)


def lora_modules(model: torch.nn.Module) -> list[ParallelLoRA]:
    """Every LoRA of the model, in model order (the same order on every rank); in a model with slots, the active
    slot's (none while no slot is active)."""
    table = getattr(model, "lora_slots", None)
    if table is not None:
        loras = table.active_loras()
        return [] if loras is None else list(loras.values())
    return [m for m in model.modules() if isinstance(m, ParallelLoRA)]


def lora_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for lora in lora_modules(model) for p in (lora.lora_A, lora.lora_B)]


@contextlib.contextmanager
def enabled(model: torch.nn.Module, on: bool = True) -> Iterator[None]:
    """Within: every LoRA applies (``on``) or contributes nothing (the base policy, the KL reference)."""
    loras = lora_modules(model)
    before = [lora.enabled for lora in loras]
    for lora in loras:
        lora.enabled = on
    try:
        yield
    finally:
        for lora, state in zip(loras, before, strict=True):
            lora.enabled = state


def disabled(model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    return enabled(model, False)


# ---- gradients ----


def reduce_lora_grads(model: torch.nn.Module) -> None:
    """Complete every LoRA gradient before the optimizer: TP partial sums, then the data-parallel mean (collective;
    a parameter without a gradient, e.g. an expert no token reached, counts as zero)."""
    from megatron.core import parallel_state

    loras = lora_modules(model)
    for lora in loras:
        for param in (lora.lora_A, lora.lora_B):
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if param.lora_tp_partial:
                dist.all_reduce(param.grad, group=lora.tp_group)
    dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    if dp_size == 1:
        return
    dense = [p.grad for lora in loras if lora.site.expert is None for p in (lora.lora_A, lora.lora_B)]
    expert = [p.grad for lora in loras if lora.site.expert is not None for p in (lora.lora_A, lora.lora_B)]
    _sum_scaled(dense, parallel_state.get_data_parallel_group(with_context_parallel=True), 1.0 / dp_size)
    _sum_scaled(expert, parallel_state.get_expert_data_parallel_group(), 1.0 / dp_size)


def _sum_scaled(grads: list[torch.Tensor], group, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads]) * scale
    if group.size() > 1:
        dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def grad_norm(model: torch.nn.Module) -> float:
    """The L2 norm of the whole (unsharded) LoRA gradient, each weight counted once; collective, after
    ``reduce_lora_grads``: TP shards are summed over TP, experts over EP, replicated copies counted once."""
    from megatron.core import parallel_state

    tp_sharded, replicated, expert = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    for lora in lora_modules(model):
        for param, sharded in ((lora.lora_A, not lora.column), (lora.lora_B, lora.column)):
            square = param.grad.float().pow(2).sum() if param.grad is not None else torch.zeros(())
            if lora.site.expert is not None:
                expert += square
            elif sharded and lora.communicates:
                tp_sharded += square
            else:
                replicated += square
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tp_sharded, group=parallel_state.get_tensor_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        dist.all_reduce(expert, group=parallel_state.get_expert_model_parallel_group())
    return float((tp_sharded + replicated + expert).sqrt())


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Scale the LoRA gradients so their global norm is at most ``max_norm`` (<= 0: no clipping); return the norm
    before clipping. Collective; every rank applies the same factor."""
    norm = grad_norm(model)
    if max_norm > 0 and norm > max_norm:
        factor = max_norm / (norm + 1e-6)
        for param in lora_parameters(model):
            if param.grad is not None:
                param.grad.mul_(factor)
    return norm
