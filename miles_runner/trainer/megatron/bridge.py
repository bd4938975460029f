"""lora_mode=bridge: the model and its LoRA built by Megatron-Bridge (AutoBridge + its PEFT LoRA), the adapter
exported by Bridge's own ``save_hf_adapter``.

The flow is Bridge's: ``AutoBridge.from_hf_pretrained(folder)`` -> ``to_megatron_provider()`` (the HF weights
load in its pre-wrap hook) with the CPU settings below -> ``provide_distributed_model(wrap_with_ddp=False)``;
then Bridge's ``LoRA`` (A xavier, B zero: its defaults, as miles' create_lora_instance sets them) on the megatron
modules the HF target names map to (raw_lora.megatron_targets: q/k/v -> linear_qkv, gate/up -> linear_fc1, ...).
The GPTModel sits in a MegatronCausalLM (``BridgeLoRAModel``), so forward(input_ids, attention_mask).logits is
the full vocabulary and the shared loss code trains it like any other model. ``BridgeTrainer`` is MegatronTrainer
with this model and LoRA (trainer/ranks.py picks it for lora_mode=bridge).

Megatron-Bridge 0.6.2 needs Python 3.12 (pyproject's gpu extra; on CPU the ``.venv-bridge`` of ``make
bridge-env``). Its CPU stand-ins are bridge_compat's; megatron's own DDP wrapper is not used (its CUDA stream).

Routing replay (R3): Bridge's model is a megatron-core GPTModel, so model.enable_routing_replay puts the same
RouteReplay in each router's replay hook as lora_mode=raw; MegatronTrainer's replay of the rollout's routes
(packing, the routing_replay_diff_frac metric) then runs unchanged, and model.routing_layout reads the layout from
the TransformerConfig Bridge built.

Tested on CPU (tests/trainer/megatron/bridge): dense and Qwen3-MoE at TP=2 (+SP), DP=2 and EP=2 train and export
the same adapter as one process; tiny-glm5 (GLM-5: MLA + DSA, bridge_compat's local DSA attention) at TP=1 with
LoRA on its MLA linears (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj). Known limit: Bridge's export
of expert LoRA is wrong with EP > 1 -- each EP rank exports its local experts numbered from 0, so the names
collide and half the experts' adapters are lost (``EXPERT_EXPORT_REFUSAL``; a plan rule refuses bridge + expert
targets + EP > 1).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from miles_runner.core.adapters import AdapterSpec
from miles_runner.trainer.megatron.bridge_compat import (
    apply_bridge_adaptations,
    dsa_local_block_spec,
    honour_attention_masks,
    uses_dsa,
)
from miles_runner.trainer.megatron.model import MegatronCausalLM, enable_routing_replay, recompute_layers
from miles_runner.trainer.megatron.multi_lora import MegatronMultiLoRATrainer
from miles_runner.trainer.megatron.parallel import Layout
from miles_runner.trainer.megatron.raw_lora import megatron_targets
from miles_runner.trainer.megatron.trainer import MegatronTrainer
from miles_runner.trainer.multi_lora import MultiLoRASettings
from miles_runner.trainer.policy_trainer import TrainerSettings

EXPERT_TARGETS = ("gate_proj", "up_proj", "down_proj")  # on a MoE model these name every expert's linears
EXPERT_EXPORT_REFUSAL = (
    "lora_mode=bridge cannot export LoRA on MoE experts with expert parallelism (ep > 1): Megatron-Bridge 0.6.2's "
    "save_hf_adapter names each EP rank's local experts from 0, so the ranks' expert adapters collide and half of "
    "them are lost (measured on tiny-moe at EP=2: the file has adapters for experts 0-3 only, and "
    "peft.PeftModel.from_pretrained refuses it with a size mismatch). Use ep=1, drop gate_proj/up_proj/down_proj "
    "from adapter.target_modules, or lora_mode=raw"
)


def cpu_overrides(layout: Layout, *, moe: bool, dsa: bool = False) -> dict[str, Any]:
    """The provider settings a CPU run needs (and the parallel layout): megatron's local layer spec instead of
    Transformer Engine's (for DSA attention, GLM-5's, bridge_compat's local stand-in), fp32, no fused kernels, the
    allgather MoE dispatcher (alltoall needs a CUDA stream) without shared-expert overlap (a CUDA stream too), no
    aux loss (the policy loss alone trains the adapter, as with lora_mode=raw), logits gathered over TP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    overrides: dict[str, Any] = dict(
        transformer_layer_spec=dsa_local_block_spec
        if dsa
        else lambda config: get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm"),
        parallel_output=False,
        masked_softmax_fusion=False,
        cross_entropy_loss_fusion=False,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        autocast_dtype=torch.float32,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sp,
    )
    if moe:
        overrides.update(
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_permute_fusion=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_shared_expert_overlap=False,
        )
    if dsa:
        # The indexer is frozen under LoRA and its KL loss reaches nothing else (megatron detaches its inputs):
        # computing it would only cost time.
        overrides.update(dsa_indexer_loss_coeff=0.0)
    return overrides


class BridgeLoRAModel(MegatronCausalLM):
    """A Bridge-built GPTModel (``.gpt``) with Bridge's LoRA applied, called like an HF causal LM; ``.bridge`` is
    the AutoBridge, ``.lora`` the LoRA config that export needs."""

    def __init__(self, gpt: torch.nn.Module, hf_folder: str, layout: Layout, bridge: Any, lora: Any) -> None:
        hf_config = json.loads((Path(hf_folder) / "config.json").read_text())
        super().__init__(gpt, hf_config, layout, routing_replay=False)
        self.hf_folder = hf_folder
        self.bridge = bridge
        self.lora = lora

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        """The trainable adapter parameters (Bridge froze everything else), in model order."""
        return [p for p in self.gpt.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within: the adapters contribute nothing (the base policy, the KL reference)."""
        with self.lora.disable_adapter(self.gpt):
            yield

    def reduce_grads(self) -> None:
        """Complete the adapter gradients as megatron's DDP would (collective): Bridge's adapter linears already do
        their tensor-parallel sums; every gradient is divided by the data-parallel size and summed over the ranks
        holding the same weights -- the data-parallel group, or for expert adapters (``allreduce`` False) the
        expert-data-parallel group, which also spans the TP ranks when the experts are not TP-sharded (etp=1)."""
        from megatron.core import parallel_state

        scale = 1.0 / parallel_state.get_data_parallel_world_size()
        by_group: dict[Any, list[torch.Tensor]] = {}
        for param in self.lora_parameters():
            if param.grad is None:  # an expert no token reached
                param.grad = torch.zeros_like(param)
            expert = not getattr(param, "allreduce", True)
            group = (
                parallel_state.get_expert_data_parallel_group() if expert else parallel_state.get_data_parallel_group()
            )
            by_group.setdefault(group, []).append(param.grad)
        for group, grads in by_group.items():
            if dist.get_world_size(group) == 1 and scale == 1.0:
                continue
            flat = torch.cat([grad.reshape(-1) for grad in grads]) * scale
            dist.all_reduce(flat, group=group)
            for grad, reduced in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
                grad.copy_(reduced.view_as(grad))

    def grad_norm(self) -> float:
        """The L2 norm of the whole adapter gradient, each weight counted once (collective, after reduce_grads):
        Bridge's adapter linears are all TP-sharded, so the squares are summed over the model-parallel group, and
        for experts over the expert-model-parallel group (experts split over EP, replicated over expert DP)."""
        from megatron.core import parallel_state

        dense, expert = torch.zeros(1), torch.zeros(1)
        for param in self.lora_parameters():
            if param.grad is not None:
                square = param.grad.detach().float().pow(2).sum()
                if getattr(param, "allreduce", True):
                    dense += square
                else:
                    expert += square
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        dist.all_reduce(expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
        return float((dense + expert).sqrt())

    def adapter_config(self) -> dict[str, Any]:
        """The PEFT config save_hf_adapter writes for this adapter (collective: it reads the exported names)."""
        from megatron.bridge.models.conversion.peft_bridge import (
            build_adapter_config_dict,
            convert_adapter_weights_to_peft_state,
            infer_rank_pattern_from_adapter_weights,
            infer_target_modules_from_adapter_weights,
        )

        weights = list(self.bridge.export_adapter_weights([self.gpt], cpu=True, show_progress=False))
        _, module_keys, target_parameters = convert_adapter_weights_to_peft_state(weights)
        return build_adapter_config_dict(
            self.lora,
            target_modules=infer_target_modules_from_adapter_weights(module_keys),
            target_parameters=target_parameters,
            base_model_name_or_path=self.hf_folder,
            rank_pattern=infer_rank_pattern_from_adapter_weights(weights, default_rank=self.lora.dim),
        )

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter in PEFT names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), full on
        every rank: Bridge's own export (collective), without writing files."""
        from megatron.bridge.models.conversion.peft_bridge import convert_adapter_weights_to_peft_state

        weights = list(self.bridge.export_adapter_weights([self.gpt], cpu=True, show_progress=False))
        state, _, _ = convert_adapter_weights_to_peft_state(weights)
        return {name: tensor.detach().clone() for name, tensor in state.items()}

    def export_adapter(self, out_dir: str | Path) -> Path:
        """A PEFT folder (adapter_config.json + adapter_model.safetensors) by Bridge's save_hf_adapter; collective,
        rank 0 writes."""
        self.bridge.save_hf_adapter(
            [self.gpt],
            str(out_dir),
            peft_config=self.lora,
            base_model_name_or_path=self.hf_folder,
            show_progress=False,
        )
        return Path(out_dir)


def check_expert_export(moe: bool, adapter: AdapterSpec, layout: Layout) -> None:
    """ValueError (EXPERT_EXPORT_REFUSAL) for LoRA on MoE experts under EP > 1, whose Bridge export is wrong."""
    if moe and layout.ep > 1 and set(adapter.target_modules) & set(EXPERT_TARGETS):
        raise ValueError(EXPERT_EXPORT_REFUSAL)


def build_bridge_lora_model(
    hf_folder: str | Path,
    adapter: AdapterSpec,
    layout: Layout,
    *,
    seed: int = 0,
    routing_replay: bool = False,
    recompute: bool = False,
    allow_expert_ep: bool = False,
) -> BridgeLoRAModel:
    """Bridge's model of ``hf_folder`` for this rank (megatron's parallel state must match ``layout``: see
    parallel.initialize) with Bridge's LoRA on ``adapter``'s targets; the adapter init draws from ``seed`` (the
    same full tensors at any TP). ``routing_replay`` and ``recompute`` as in model.build_model (the same hooks on
    Bridge's GPTModel). ``allow_expert_ep`` lets a test build the refused layout to show its failure."""
    bridge, gpt, moe = build_bridge_gpt(hf_folder, layout)  # first: it makes Bridge importable on CPU
    from megatron.bridge.peft.lora import LoRA

    if not allow_expert_ep:
        check_expert_export(moe, adapter, layout)
    lora = LoRA(
        target_modules=sorted(megatron_targets(list(adapter.target_modules))),
        dim=adapter.rank,
        alpha=adapter.alpha,
        dropout=adapter.dropout,
        lora_A_init_method="xavier",
        lora_B_init_method="zero",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lora([gpt], training=True)
    model = BridgeLoRAModel(gpt, str(hf_folder), layout, bridge, lora)
    if routing_replay:
        enable_routing_replay(model)
    if recompute:
        recompute_layers(model)
    return model


def build_bridge_gpt(hf_folder: str | Path, layout: Layout) -> tuple[Any, torch.nn.Module, bool]:
    """Bridge's GPTModel of ``hf_folder`` for this rank, with the HF weights (the AutoBridge, the model, whether
    it is MoE); megatron's parallel state must match ``layout`` (parallel.initialize)."""
    apply_bridge_adaptations()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(hf_folder), torch_dtype=torch.float32)
    provider = bridge.to_megatron_provider(load_weights=True)
    moe = bool(getattr(provider, "num_moe_experts", None))
    overrides = cpu_overrides(layout, moe=moe, dsa=uses_dsa(provider))
    provider.apply_overrides_and_finalize(dtype=torch.float32, overrides=overrides)
    with warnings.catch_warnings():
        # Bridge 0.6.2 deprecates its provider API, yet an HF checkpoint reaches megatron only through a provider
        # (its own AutoBridge.to_megatron_model calls provide_distributed_model): there is no other path to take.
        warnings.filterwarnings("ignore", "ModelProviderMixin-based", DeprecationWarning)
        (gpt,) = provider.provide_distributed_model(
            wrap_with_ddp=False, use_cpu_initialization=True, mixed_precision_wrapper=None
        )
    honour_attention_masks(gpt)  # packed rows: each sample reads its own tokens only
    return bridge, gpt, moe


class BridgeTrainer(MegatronTrainer):
    """The Megatron trainer with ``lora_mode=bridge``: everything but the model and its LoRA is MegatronTrainer's
    (loss, micro-batches, metrics, checkpoints); the model is Bridge's, its adapter Bridge's LoRA, exported in
    PEFT names by Bridge. Starting from a PEFT adapter (adapters.path) is refused: Megatron-Bridge 0.6.2 has no
    PEFT -> megatron adapter import (a checkpoint resumes from each rank's own LoRA shards)."""

    def _build_model(self, hf_config: dict, settings: TrainerSettings) -> torch.nn.Module:
        s = settings
        if s.adapter.init_path:
            raise ValueError(
                f"adapters.path={s.adapter.init_path!r}: lora_mode=bridge cannot start from a PEFT "
                "adapter (Megatron-Bridge 0.6.2 has no PEFT -> megatron import); use "
                "lora_mode=raw"
            )
        return build_bridge_lora_model(
            self.model_path, s.adapter, self.layout, seed=s.seed, routing_replay=s.routing_replay, recompute=s.recompute
        )

    def _lora_parameters(self) -> list[torch.nn.Parameter]:
        return self.model.lora_parameters()

    def _adapter_enabled(self, on: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if on else self.model.disabled()

    def _complete_grads(self) -> float:
        self.model.reduce_grads()
        norm = self.model.grad_norm()
        clip = self.settings.optimizer.clip_grad
        if clip > 0 and norm > clip:
            for param in self.model.lora_parameters():
                param.grad.mul_(clip / (norm + 1e-6))
        return norm

    def _load_peft_state(self, state: dict[str, torch.Tensor]) -> None:
        raise ValueError(
            "lora_mode=bridge cannot load a PEFT adapter state (Megatron-Bridge 0.6.2 has no PEFT -> "
            "megatron import): train with lora_mode=raw to start from one"
        )

    def _write_adapter(self, folder: Path) -> None:
        self.model.export_adapter(folder)  # Bridge's save_hf_adapter

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return self.model.adapter_state()

    def adapter_config(self) -> dict[str, Any]:
        """Bridge's PEFT config of ``adapter_state`` (what save_hf_adapter writes)."""
        return self.model.adapter_config()


class BridgeMultiLoRATrainer(MegatronMultiLoRATrainer):
    """Megatron multi-LoRA with ``lora_mode=bridge``: Bridge builds the model and loads the HF weights, and the
    slots are raw LoRA slots on its linears (raw_lora.attach_slot), exported in PEFT names by lora_export.
    miles' slots are Megatron-Bridge's MultiLoRA, which no release up to the pinned 0.6.2 has; the plan says so
    (plan.summary) and refuses families the export does not name (bridge-multi-lora-needs-converter)."""

    def _build_model(self, hf_config: dict, settings: MultiLoRASettings) -> torch.nn.Module:
        _, gpt, _ = build_bridge_gpt(self.model_path, self.layout)
        for param in gpt.parameters():
            param.requires_grad_(False)
        model = MegatronCausalLM(gpt, hf_config, self.layout, routing_replay=False)
        if settings.routing_replay:
            enable_routing_replay(model)
        if settings.recompute:
            recompute_layers(model)
        return model
