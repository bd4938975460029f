"""A megatron-core GPTModel built from an HF config, called like an HF causal LM.

Supported HF ``model_type``: ``qwen3_moe`` (tiny-moe), ``qwen3`` (tiny-dense) and ``qwen2`` (Qwen2.5: qkv bias).
One TransformerConfig builder covers them: the local (megatron-core only) layer spec, RMSNorm, RoPE with the
config's theta, qk-layernorm for qwen3*, SwiGLU, fp32, CPU initialisation and no fusions; MoE layers route top-k
over a softmax (renormalised over the top-k when ``norm_topk_prob``) without aux loss, through the allgather
dispatcher (the alltoall one needs a CUDA stream).

``MegatronCausalLM.forward(input_ids, attention_mask)`` returns ``SimpleNamespace(logits=[B, L, V])`` gathered over
TP (differentiably), so the shared trainer code calls it exactly like an HF model. Rows are right-padded: the mask
is causal and never lets a real position read padding. ``segment_ids`` instead of ``attention_mask`` is a packed
(THD-like) row: a token reads only earlier tokens of its own segment. Under sequence parallelism the width is
padded to a multiple of TP inside the forward and the logits cut back.

``recompute=True`` checkpoints every decoder layer (torch's non-reentrant checkpoint, not megatron's, whose RNG
bookkeeping is CUDA-only); a layer recomputed in the backward routes as its forward did, replayed routes included.

Routing replay (R3): ``replay_routing(model, routes)`` is ``trainer/routing_replay.replaying`` for this model.
It plugs into megatron-core's own replay hook (``TopKRouter.router_replay``, what ``moe_enable_routing_replay``
installs) with an object that also keeps a token's own routing where its row is -1, which megatron's
``RouterReplay`` cannot. Gate weights are megatron's replay weights: the softmax scores gathered at the replayed
experts, i.e. the softmax over all experts at those experts, renormalised over them when ``norm_topk_prob``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor

from miles_runner.core.megatron_families import RAW_LORA_FAMILIES
from miles_runner.models.moe_routing import RoutingLayout
from miles_runner.trainer.megatron.cpu_compat import apply_cpu_adaptations
from miles_runner.trainer.megatron.parallel import Layout
from miles_runner.trainer.routing_replay import NO_ROW, ReplayStats, differs

SUPPORTED_MODEL_TYPES = RAW_LORA_FAMILIES  # the plan checks model.family against the same table


def check_model_type(hf_config: dict) -> str:
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"the megatron trainer has no converter for model_type {model_type!r}; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (use trainer.backend=fsdp for other models)"
        )
    return model_type


def num_experts(hf_config: dict) -> int:
    """Experts per MoE layer (transformers 5 writes ``num_local_experts``, older configs ``num_experts``); 0: dense."""
    if hf_config["model_type"] != "qwen3_moe":
        return 0
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def moe_layers(hf_config: dict) -> tuple[int, ...]:
    """The decoder layers with a router (Qwen3-MoE's ``mlp_only_layers``, ``decoder_sparse_step`` keep some dense)."""
    if not num_experts(hf_config):
        return ()
    step = int(hf_config.get("decoder_sparse_step") or 1)
    dense = set(hf_config.get("mlp_only_layers") or ())
    return tuple(i for i in range(hf_config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def head_dim(hf_config: dict) -> int:
    return int(hf_config.get("head_dim") or hf_config["hidden_size"] // hf_config["num_attention_heads"])


def rope_theta(hf_config: dict) -> float:
    """RoPE base; scaled RoPE variants (yarn, linear, ...) are refused, not silently run unscaled."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by the megatron model builder (default RoPE only)")
    return float(rope.get("rope_theta") or hf_config.get("rope_theta") or 10000.0)


def padded_vocab_size(hf_config: dict, layout: Layout) -> int:
    """The vocabulary rounded up to a multiple of TP (megatron splits it evenly); the extra rows are never read."""
    return math.ceil(hf_config["vocab_size"] / layout.tp) * layout.tp


def _refuse_unsupported(hf_config: dict, layout: Layout) -> None:
    if layout.pp != 1:
        raise ValueError(f"pipeline parallelism (pp={layout.pp}) is not supported by the megatron trainer; use pp=1")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported by the megatron model builder")
    if num_experts(hf_config) and layout.tp > 1 and not layout.sp:
        raise ValueError("a MoE model with tp > 1 needs sequence parallelism (Layout.sp=True), as megatron requires")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf_config['hidden_act']!r}: only silu (SwiGLU) is supported")


def transformer_config(hf_config: dict, layout: Layout):
    """The megatron TransformerConfig of an HF config under ``layout`` (fp32, CPU init, no fusions, no dropout)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type = check_model_type(hf_config)
    _refuse_unsupported(hf_config, layout)
    layers = int(hf_config["num_hidden_layers"])
    experts = num_experts(hf_config)
    moe: dict[str, Any] = {}
    if experts:
        routed = set(moe_layers(hf_config))
        moe = dict(
            num_moe_experts=experts,
            moe_ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
            moe_router_topk=int(hf_config["num_experts_per_tok"]),
            # pre-softmax: softmax over all experts, then top-k (unnormalised); otherwise softmax over the top-k
            # logits, which is the full softmax renormalised over the chosen experts (norm_topk_prob).
            moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
            moe_layer_freq=[1 if i in routed else 0 for i in range(layers)],
        )
    return TransformerConfig(
        num_layers=layers,
        hidden_size=int(hf_config["hidden_size"]),
        num_attention_heads=int(hf_config["num_attention_heads"]),
        num_query_groups=int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]),
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        normalization="RMSNorm",
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type.startswith("qwen3"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        sequence_parallel=layout.sp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        **moe,
    )


@dataclass(eq=False)
class RouteReplay:
    """One router's replay hook (megatron-core calls ``get_replay_topk`` in place of its top-k): the rows of
    ``target`` ``[tokens, top_k]`` choose the experts, except rows starting with -1, which keep the router's own."""

    target: Tensor | None = None
    differing: Tensor | None = None  # [tokens] bool, shared by the layers of one forward

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None):
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return own_scores, own
        if self.target.shape != own.shape:
            raise ValueError(
                f"routing replay: {tuple(self.target.shape)} replay rows for a router forward of "
                f"{tuple(own.shape)} (tokens, top_k)"
            )
        wanted = self.target.to(own.device, torch.long)
        replayed = torch.where(wanted[:, :1] == NO_ROW, own, wanted)
        if self.differing is not None:
            self.differing.logical_or_(differs(own, replayed).cpu())
        return scores.gather(1, replayed), replayed


@dataclass
class _ActiveReplay:
    routes: Tensor  # [B, L, num_layers, top_k] in the packed batch's order
    stats: ReplayStats | None
    has_row: Tensor | None = None  # [local tokens] bool, set by the first forward
    differing: Tensor | None = None  # [local tokens] bool: own routing differs in any layer, in any forward


class MegatronCausalLM(torch.nn.Module):
    """A GPTModel (``.gpt``) with an HF causal LM's call: ``model(input_ids=, attention_mask=).logits``."""

    def __init__(self, gpt: torch.nn.Module, hf_config: dict, layout: Layout, routing_replay: bool) -> None:
        super().__init__()
        self.gpt = gpt
        self.hf_config = dict(hf_config)
        self.layout = layout
        self.routing_replay = routing_replay
        self.vocab_size = int(hf_config["vocab_size"])
        self._replay: _ActiveReplay | None = None

    def routers(self) -> list[tuple[int, torch.nn.Module]]:
        """``(decoder layer index, TopKRouter)`` of every MoE layer, in layer order."""
        found = []
        for index, layer in enumerate(self.gpt.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                found.append((index, router))
        return found

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, *, segment_ids: Tensor | None = None
    ) -> SimpleNamespace:
        """Logits ``[B, L, V]`` of right-padded rows (``attention_mask``), or of packed rows (``segment_ids``:
        the sample each token belongs to, -1 for padding); neither: every token is real."""
        if attention_mask is not None and segment_ids is not None:
            raise ValueError("pass attention_mask (padded rows) or segment_ids (packed rows), not both")
        batch, width = input_ids.shape
        pad = (-width) % self.layout.tp if self.layout.sp else 0
        ids = F.pad(input_ids, (0, pad))
        if segment_ids is not None:
            blocked = _blocked_positions(F.pad(segment_ids, (0, pad), value=-1))
        else:
            valid = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            blocked = _masked_positions(F.pad(valid, (0, pad)).bool())
        positions = torch.arange(width + pad, device=ids.device).unsqueeze(0).expand(batch, -1)
        with self._routes_for(batch, width, pad):
            logits = self.gpt(ids, positions, blocked)
        return SimpleNamespace(logits=logits[:, :width, : self.vocab_size])

    @contextmanager
    def _routes_for(self, batch: int, width: int, pad: int) -> Iterator[None]:
        """Hand each router this forward's rows in its own token order (megatron flattens its local ``[S, B]``
        sequence-major; under SP a rank's routers see only its sequence shard)."""
        active = self._replay
        if active is None:
            yield
            return
        routes = active.routes
        if tuple(routes.shape[:2]) != (batch, width):
            raise ValueError(
                f"routing replay: routes for {tuple(routes.shape[:2])} (rows, tokens), a forward of {(batch, width)}"
            )
        top_k = routes.shape[3]
        routes = F.pad(routes, (0, 0, 0, 0, 0, pad), value=NO_ROW)
        routes = _local_sequence(routes, self.layout).transpose(0, 1)  # [S_local, B, num_layers, top_k]
        routers = self.routers()
        if active.differing is None:  # later forwards of the same batch route the same tokens
            active.has_row = routes[:, :, routers[0][0], 0].reshape(-1) != NO_ROW
            active.differing = torch.zeros_like(active.has_row)
        for layer, router in routers:
            router.router_replay.target = routes[:, :, layer, :].reshape(-1, top_k)
            router.router_replay.differing = active.differing
        try:
            yield
        finally:
            for _, router in routers:
                router.router_replay.target = router.router_replay.differing = None


def _causal(width: int, device: torch.device) -> Tensor:
    return torch.ones(width, width, dtype=torch.bool, device=device).tril()


def _masked_positions(valid: Tensor) -> Tensor:
    """megatron's attention mask ``[B, 1, L, L]``, True where a query may NOT read a key: future keys and padding."""
    return ~(_causal(valid.shape[1], valid.device).unsqueeze(0) & valid[:, None, :]).unsqueeze(1)


def _blocked_positions(segments: Tensor) -> Tensor:
    """The mask of packed rows: a query reads only earlier keys of its own segment."""
    same = segments[:, :, None] == segments[:, None, :]
    return ~(_causal(segments.shape[1], segments.device).unsqueeze(0) & same).unsqueeze(1)


def _local_sequence(routes: Tensor, layout: Layout) -> Tensor:
    """The sequence shard this rank's routers see: all of it, or the TP rank's 1/tp under sequence parallelism."""
    if not layout.sp:
        return routes
    from megatron.core import parallel_state

    return routes.chunk(layout.tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]


def build_model(
    hf_config: dict, layout: Layout, *, routing_replay: bool = False, recompute: bool = False
) -> MegatronCausalLM:
    """The megatron model of ``hf_config`` for this rank (megatron's parallel state must match ``layout``; see
    parallel.initialize), randomly initialised: load weights with convert.load_hf_checkpoint. ``recompute``:
    activation recomputation of every decoder layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    apply_cpu_adaptations()
    config = transformer_config(hf_config, layout)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config, layout),
        max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
        parallel_output=False,  # logits gathered over TP, differentiably
        share_embeddings_and_output_weights=bool(hf_config.get("tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    model = MegatronCausalLM(gpt, hf_config, layout, routing_replay=False)
    if routing_replay:
        enable_routing_replay(model)
    if recompute:
        recompute_layers(model)
    return model


def enable_routing_replay(model: MegatronCausalLM) -> None:
    """Put a RouteReplay in megatron-core's replay hook of every router, so replay_routing works on ``model`` (a
    model build_model made, or Megatron-Bridge's GPTModel in one); ValueError for a model without routers."""
    routers = model.routers()
    if not routers:
        raise ValueError(f"routing replay needs a MoE model; model_type {model.hf_config.get('model_type')!r} is dense")
    for _, router in routers:
        router.router_replay = RouteReplay()
    model.routing_replay = True


def recompute_layers(model: MegatronCausalLM) -> None:
    """Activation recomputation of every decoder layer (torch's non-reentrant checkpoint); a recomputed layer
    routes in the backward as its forward did, whether replay is enabled before or after."""
    for layer in model.gpt.decoder.layers:
        layer.forward = functools.partial(_recomputed, layer.forward, layer)


def _replay_hooks(module: torch.nn.Module) -> list[RouteReplay]:
    return [m.router_replay for m in module.modules() if isinstance(getattr(m, "router_replay", None), RouteReplay)]


def _recomputed(forward: Callable, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A decoder layer's forward that keeps only its inputs, run again in the backward with the replay rows its
    routers had in the forward (the replay context may be over by then, or hold another micro-batch's rows)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)

    def contexts():
        saved = [(hook, hook.target, hook.differing) for hook in _replay_hooks(layer)]
        return nullcontext(), _routes_restored(saved)

    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextmanager
def _routes_restored(saved: list[tuple[RouteReplay, Tensor | None, Tensor | None]]) -> Iterator[None]:
    current = [(hook, hook.target, hook.differing) for hook, _, _ in saved]
    for hook, target, differing in saved:
        hook.target, hook.differing = target, differing
    try:
        yield
    finally:
        for hook, target, differing in current:
            hook.target, hook.differing = target, differing


def routing_layout(model: MegatronCausalLM) -> RoutingLayout:
    """The model's routing rows ``(tokens, num_layers, top_k)``, as moe_routing.routing_layout for an HF model;
    read from the GPTModel's TransformerConfig, so a model Megatron-Bridge built from any HF family answers too."""
    config = model.gpt.config
    if not config.num_moe_experts:
        raise ValueError(
            f"routing replay needs a MoE model; model_type {model.hf_config.get('model_type')!r} has no router"
        )
    return RoutingLayout(
        num_layers=config.num_layers,
        top_k=config.moe_router_topk,
        num_experts=config.num_moe_experts,
        moe_layers=routed_layers(config),
    )


def routed_layers(config: Any) -> tuple[int, ...]:
    """The decoder layers with a router, by megatron's reading of ``moe_layer_freq`` (gpt_layer_specs): an int N
    routes every layer i with i % N == 0, a list marks each layer 1 (MoE) or 0 (dense)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i for i in range(config.num_layers) if i % freq == 0)
    if isinstance(freq, list) and len(freq) == config.num_layers:
        return tuple(i for i, routed in enumerate(freq) if routed)
    raise ValueError(f"moe_layer_freq {freq!r}: expected an int or a 0/1 list of {config.num_layers} layers")


def replay_routing(model: MegatronCausalLM, routes: Tensor | None, stats: ReplayStats | None = None):
    """A context in which every forward routes as ``routes`` ``[B, L, num_layers, top_k]`` (int32, the packed
    batch's order; -1 rows keep the model's own routing) say; a no-op for None. ``stats`` adds the replayed tokens
    and those the model's own router would have sent elsewhere in any layer (summed over the TP ranks under SP)."""
    return nullcontext() if routes is None else _replaying(model, routes, stats)


@contextmanager
def _replaying(model: MegatronCausalLM, routes: Tensor, stats: ReplayStats | None) -> Iterator[None]:
    if not model.routing_replay:
        raise ValueError(
            "routing replay: build the model with build_model(..., routing_replay=True) or call "
            "enable_routing_replay(model) first"
        )
    if model._replay is not None:
        if model._replay.routes is not routes:
            raise ValueError("routing replay: a forward with other routes inside a replay of this batch")
        yield
        return
    model._replay = active = _ActiveReplay(routes, stats)
    try:
        yield
    finally:
        model._replay = None
    if stats is not None:
        _count(active, model.layout, stats)


def _count(active: _ActiveReplay, layout: Layout, stats: ReplayStats) -> None:
    if active.has_row is None:
        return
    counts = torch.stack([active.has_row.sum(), (active.differing & active.has_row).sum()])
    if layout.sp:
        from megatron.core import parallel_state

        dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
    stats.tokens += int(counts[0])
    stats.differing += int(counts[1])
