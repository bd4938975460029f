"""Settings only one backend honours, and what this release does not run yet.

A plan that compiles runs exactly as it reads, so a setting the plan's backends would silently ignore is a plan
error here, with the backend that honours it. The `*-not-built` rules refuse what is specified (docs/system.md §1.2
accepts it) but not built in this release: compiling such a plan would otherwise print one trainer and run
another. `compile_design` in plan/compile.py skips exactly these (NOT_BUILT) to review a future plan.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import EngineConfig, MilesConfig, SessionConfig
from miles_runner.plan.derive import Derived, parse_tiny_model
from miles_runner.plan.model_shape import checkpoint_config
from miles_runner.plan.rules.base import ADAPTERS, BACKEND, LORA_MODE, Finding, rule

# Rule ids of the refusals of what this release has not built (docs/refusals.md lists them).
NOT_BUILT = (
    "embedded-engine-dsa-sparse-topk-not-built",
    "full-weight-training-not-built",
    "fully-async-not-built",
    "train-only-adapter-not-built",
    "fsdp-trainer-on-gpus-not-built",
)

# SGLang launch settings the embedded CPU engine has no counterpart for: only their defaults are accepted.
SGLANG_ONLY_ENGINE_SETTINGS = (
    "mem_fraction_static",
    "lora_backend",
    "enable_cuda_graph",
    "dp_attention",
    "fp8_rollout",
    "extra_args",
)


@rule("full-weight-training-not-built")
def full_weight_training_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.lora_enabled:
        yield Finding(
            (ADAPTERS, LORA_MODE),
            "Full-weight training is not built in this release: the trainers train LoRA adapters.",
            "adapters=single lora_mode=peft",
        )


@rule("fully-async-not-built")
def fully_async_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async:
        yield Finding(
            ("rollout.fully_async",),
            "The fully-async rollout (a generation loop that never waits for training) is not built in this "
            "release; the async schedule overlaps one step's generation with the previous step's training.",
            "rollout.fully_async=false",
        )


@rule("train-only-adapter-not-built")
def train_only_adapter_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.adapters.train_only and d.lora_enabled:
        yield Finding(
            ("adapters.train_only",),
            "Training an adapter while the engines roll out with the base model is not built: the loops push every "
            "adapter version to the engines, check that they serve it and bound the rollouts' staleness by it.",
            "adapters.train_only=false",
        )


@rule("fsdp-trainer-on-gpus-not-built")
def fsdp_trainer_on_gpus_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "fsdp" and not cfg.cluster.cpu_only:
        yield Finding(
            (BACKEND, "cluster.cpu_only"),
            "The FSDP trainer of this release trains on the host CPU (it places nothing on CUDA devices): on a GPU "
            "cluster its GPUs would sit idle. GPU training is the Megatron trainer's.",
            "cluster=cpu engine=embedded",
        )


@rule("embedded-engine-dsa-sparse-topk-not-built")
def embedded_engine_dsa_sparse_topk_not_built(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """The embedded engine runs transformers' DSA indexer, which keeps each query's index_topk best-scored keys. Its
    top-k breaks tied scores (ReLU makes exact zeros common) by column, and a ragged batch's padding or a prefix-cache
    hit moves the columns: once a context outgrows index_topk, a request's attention would depend on the requests
    beside it. Within index_topk tokens every key is kept, whatever the layout. A checkpoint not on this machine is
    checked by the engine at start."""
    m = cfg.model
    if cfg.engine.kind != "embedded" or not m.has_dsa_indexer:
        return
    tiny = parse_tiny_model(m.path)
    index_topk = (checkpoint_config(d.model_path, tiny[0] if tiny else None) or {}).get("index_topk")
    if index_topk is not None and m.max_context_len > index_topk:
        yield Finding(
            ("engine.kind", "model.max_context_len", "model.has_dsa_indexer"),
            f"The embedded engine serves {m.name}'s DSA indexer only while it keeps every token: a context of "
            f"{m.max_context_len} tokens outgrows its index_topk of {index_topk}, and its sparse selection, whose "
            "ties depend on the batch's padding, is not built batch-invariant; SGLang serves it, on GPUs.",
            f"model.max_context_len={index_topk}",
        )


@rule("embedded-engine-within-a-node")
def embedded_engine_within_a_node(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """An SGLang engine wider than a node runs one node rank per node (--nnodes); the embedded one cannot."""
    wider = cfg.cluster.nodes > 1 and d.num_engines and cfg.engine.tp_size > d.devices_per_node
    if cfg.engine.kind == "embedded" and wider:
        yield Finding(
            ("engine.kind", "engine.tp_size", "cluster.nodes"),
            f"An engine of TP {cfg.engine.tp_size} spans nodes of {d.devices_per_node} devices, but the embedded CPU "
            "engine is one process on one node; only SGLang runs an engine over several nodes (--nnodes).",
            f"engine.tp_size={d.devices_per_node}",
        )


@rule("multi-node-session-host")
def multi_node_session_host(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.cluster.nodes > 1 and cfg.session.version != "off" and cfg.session.host != SessionConfig.host:
        yield Finding(
            ("session.host", "cluster.nodes"),
            "On a plan that spans nodes the session server binds its node's own address (node 0's, filled in when "
            "the run starts) so that the other nodes reach it; session.host is the single-node bind address.",
            f"session.host={SessionConfig.host}",
        )


@rule("embedded-engine-takes-no-sglang-gpu-settings")
def embedded_engine_takes_no_sglang_gpu_settings(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind != "embedded":
        return
    for name in SGLANG_ONLY_ENGINE_SETTINGS:
        value = getattr(cfg.engine, name)
        if value != _engine_default(name):
            yield Finding(
                ("engine.kind", f"engine.{name}"),
                f"engine.{name} is an SGLang GPU launch setting; the embedded CPU engine has no counterpart and "
                "would ignore it.",
                f"engine.{name}={_override_text(_engine_default(name))}",
            )
    if cfg.adapters.base_cpu_backup and not d.offload_rollout:
        yield Finding(
            ("engine.kind", "adapters.base_cpu_backup", "topology.offload_rollout"),
            "adapters.base_cpu_backup keeps the base weights an engine releases, to restore them from; without "
            "rollout offload the embedded engine never releases them.",
            "adapters.base_cpu_backup=false",
        )


@rule("cpu-backup-needs-colocated-lora-rollout")
def cpu_backup_needs_colocated_lora_rollout(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.adapters.base_cpu_backup and not (d.colocated and d.lora_rollout_enabled):
        yield Finding(
            ("adapters.base_cpu_backup", "topology.kind", "adapters.train_only"),
            "The base CPU backup exists for colocated engines that roll out with the adapter (spec: LoRA, "
            "colocate and the flag); on this plan no engine would take it.",
            "adapters.base_cpu_backup=false",
        )


@rule("megatron-lora-layouts-need-megatron")
def megatron_lora_layouts_need_megatron(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.lora_enabled or cfg.trainer.backend == "megatron":
        return
    if cfg.adapters.lora_type != "lora":
        yield Finding(
            ("adapters.lora_type", BACKEND),
            "canonical_lora splits Megatron's fused linear_qkv and linear_fc1 into one LoRA per projection; "
            "peft on a Hugging Face model already trains one LoRA per projection (q_proj, k_proj, ...).",
            "adapters.lora_type=lora",
        )
    if cfg.model.native_lora:
        yield Finding(
            ("model.native_lora", BACKEND),
            "model.native_lora selects the model's own (raw) LoRA modules in Megatron; peft wraps the Hugging "
            "Face linears and would not use them.",
            "model.native_lora=false",
        )
    if cfg.adapters.experts_shared_outer:
        yield Finding(
            ("adapters.experts_shared_outer", BACKEND),
            "Shared-outer expert LoRA (one A or B shared by all experts) is a Megatron-Bridge layout; peft "
            "trains one LoRA per expert projection.",
            "adapters.experts_shared_outer=false",
        )


@rule("fsdp-pads-rows")
def fsdp_pads_rows(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "fsdp" and cfg.trainer.parallel.qkv_format != "bshd":
        yield Finding(
            (BACKEND, "trainer.parallel.qkv_format"),
            "The FSDP trainer right-pads each sample into a [batch, length] row (bshd); thd packing is Megatron's.",
            "trainer.parallel.qkv_format=bshd",
        )


def _engine_default(name: str) -> object:
    return getattr(EngineConfig(), name)


def _override_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "[]" if value == [] else str(value)
