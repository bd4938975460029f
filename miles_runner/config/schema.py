"""The typed configuration tree: one frozen dataclass per section.

Field defaults here are the single source of truth for default values: the Hydra base config is generated
from them (`defaults_tree`), and group options, recipes and the command line only override. Field names follow
the miles flags they stand for (see docs/system.md §1.1), with the `--` and section prefix dropped.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Literal

from miles_runner.core.sglang_protocol import ENGINE_BUILDS, MILES_FORK
from miles_runner.core.tito_families import TITO_FAMILIES

# Allowed values of the enum-like string fields, keyed by their full path. Checked by the loader, so a typo
# in `session.version=v3` is reported like a type error, with the valid choices.
CHOICES: dict[str, tuple[str, ...]] = {
    "topology.kind": ("colocated", "disaggregated"),
    "trainer.lora_mode": ("none", "bridge", "raw", "peft"),
    "adapters.kind": ("none", "single", "multi"),
    "adapters.lora_type": ("lora", "canonical_lora"),
    "trainer.backend": ("fsdp", "megatron"),
    "trainer.parallel.qkv_format": ("thd", "bshd"),
    "trainer.offload_target": ("cpu", "disk"),
    "optimizer.name": ("adam", "muon", "sgd"),
    "engine.kind": ("embedded", "sglang"),
    "engine.build": ENGINE_BUILDS,  # stock SGLang at the pinned release, or the sglang-miles fork
    "router.kind": ("none", "sglang"),
    # sglang-router 0.3.2's policies; manual keeps one X-SMG-Routing-Key on one worker.
    "router.policy": ("auto", "round_robin", "random", "cache_aware", "power_of_two", "manual"),
    "session.version": ("off", "v1", "v2"),
    "session.tito_model": tuple(TITO_FAMILIES),  # miles' TITO families this runner builds (no qwen25 in miles)
    "session.message_matcher": ("strict", "loose_tool_call", "role_content_only"),
    "executor.kind": ("local", "ray"),
    "weight_sync.pause_generation_mode": ("abort", "in_place", "retract"),
    "weight_sync.transfer_mode": ("broadcast", "p2p", "disk-delta"),
    # miles' estimators; ppo is refused by a plan rule (it needs a critic, which LoRA-only trainers lack).
    "algorithm.advantage_estimator": ("grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"),
    "rollout.schedule": ("sync", "async"),
    "logger.wandb_mode": ("offline", "online", "disabled"),
    "logger.progress": ("auto", "rich", "plain"),
}


# A server's port: a number, or "auto": a free one picked where and when the server starts (the executor records
# it in the run folder), so that runs, sweep points and Slurm jobs sharing a machine never meet on a port.
AUTO_PORT: Final = "auto"
Port = int | Literal["auto"]
OffloadLevel = Literal["kv_cache", "weight"]  # miles' --offload-rollout-level values

# Keys that were renamed, old spelling -> new: refused with a did-you-mean naming the new key (one name per concept:
# a config key, the plan field it sets and the code that reads it share it).
RENAMED_KEYS: dict[str, str] = {
    "cluster.cpu_slots_per_node": "cluster.cpu_devices_per_node",  # a "slot" is an adapter slot; hardware: device
    "rollout.driver": "rollout.schedule",  # "driver" is the miles-run process
    "lora.mode": "trainer.lora_mode",  # the plan's trainer.lora_mode; the lora_mode group sets it
}


@dataclass(frozen=True)
class RunConfig:
    name: str = "custom"
    seed: int = 1234
    output_root: str = "outputs"
    resume: bool = False  # continue the latest run of this name (or run.dir) from its last checkpoint
    dir: str = ""  # an existing run folder to resume in; empty: a new outputs/DATE/TIME


@dataclass(frozen=True)
class ClusterConfig:
    """What the job is allowed to use. On a cpu-only cluster a device (a "GPU") is one CPU worker process."""

    nodes: int = 1
    gpus_per_node: int = 0
    gpu_type: str = "none"
    gpu_memory_gb: float = 0.0
    cpu_only: bool = True
    cpu_devices_per_node: int = 2
    memory_gb_per_node: float = 24.0


@dataclass(frozen=True)
class TopologyConfig:
    kind: str = "colocated"
    actor_num_nodes: int = 0  # 0: every node of the cluster
    actor_num_gpus_per_node: int = 0  # 0: every device of the node
    rollout_num_gpus: int = 0  # disaggregated; 0: every device the trainer does not use
    offload_train: bool | None = None  # None: derived (on when colocated)
    offload_rollout: bool | None = None
    # What the engines give back after each rollout when offload_rollout is on (their CUDA graphs always).
    offload_rollout_level: list[OffloadLevel] = field(default_factory=lambda: ["kv_cache", "weight"])


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny-moe"
    path: str = "tiny:tiny-moe:format"  # tiny:NAME[:format] is built locally on first use; else an HF folder
    family: str = "qwen3_moe"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 400
    num_experts: int = 8  # 0 for a dense model
    moe_topk: int = 2
    params_b: float = 0.0003  # total parameters, billions
    kv_lora_rank: int = 0  # > 0: MLA attention (adds kv_a_proj_with_mqa, kv_b_proj to all-linear)
    q_lora_rank: int = 0  # > 0 with MLA: adds q_a_proj, q_b_proj
    has_dsa_indexer: bool = False
    native_lora: bool = False  # the model ships a native (raw) LoRA implementation
    max_context_len: int = 2048


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    micro_batch_size: int = 1
    qkv_format: str = "bshd"  # fsdp right-pads rows; Megatron packs (thd)
    recompute: bool = False


@dataclass(frozen=True)
class TrainerConfig:
    backend: str = "fsdp"
    lora_mode: str = "peft"  # set by the lora_mode group: how the backend applies LoRA
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    offload_target: str = "cpu"
    offload_disk_dir: str = (
        ""  # offload_target=disk: "" is $SCRATCH (else the temporary folder)/miles_train_offload_<uid>
    )
    offload_disk_chunk_mb: int = 64  # miles' --offload-train-disk-chunk-mb
    # The interpreter the trainer runs in, as a process of its own (trainer/host.py); "": in the driver's process.
    # Megatron-Bridge needs Python 3.12: on a laptop its side environment (`make bridge-env`) hosts the trainer.
    python: str = ""
    calculate_per_token_loss: bool = False
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int = 4096
    stream_optimizer_state_to_disk: bool = False
    rematerialize_param_from_master_weight: bool = False
    keep_old_actor: bool = False


@dataclass(frozen=True)
class AdapterEntry:
    """One entry of `adapters.runs`: an adapter of a multi-LoRA run (docs/system.md §4.1). Unset values fall back to the
    `adapters.*` defaults."""

    name: str = ""
    task: str = "arith"
    reward: str = "exact_match"
    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] = field(default_factory=list)
    lr: float | None = None
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int | None = None
    num_step: int | None = None
    num_epoch: int | None = None
    data: str = ""
    agent: str | None = None  # the agent plug-in of its episodes when a session server runs; None: rollout.agent


@dataclass(frozen=True)
class AdaptersConfig:
    kind: str = "single"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    lora_type: str = "lora"
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    exclude_modules: list[str] = field(default_factory=list)
    train_only: bool = False  # train the adapter but roll out with the base model
    base_cpu_backup: bool = False
    experts_shared_outer: bool = False
    path: str = ""  # start from an existing adapter
    runs: list[AdapterEntry] = field(default_factory=list)
    max_slots: int = 0  # multi-LoRA slots on the engines; 0: one per configured run
    api_port: Port = AUTO_PORT  # the multi-LoRA controller's HTTP API
    idle_poll_s: float = 5.0
    service_mode: bool = False
    max_coalesce_wait_s: float = 0.5
    max_empty_wait_s: float = 30.0


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "embedded"
    build: str = MILES_FORK  # which SGLang the engines are (core.sglang_protocol); conf/engine/sglang.yaml: stock
    tp_size: int = 1  # rollout_num_gpus_per_engine
    ep_size: int = 1
    dp_attention: bool = False
    base_port: Port = AUTO_PORT  # a number: engine i's node rank r serves on base_port + i + r * engines
    # An engine wider than a node: its node ranks meet at rank 0's node on dist_init_port + 10 * engine index
    # (SGLang --dist-init-addr; with DP attention SGLang also takes the next 6 ports there for its sockets).
    dist_init_port: int = 30200
    mem_fraction_static: float = 0.8
    lora_backend: str = "triton"
    max_lora_rank: int = 0  # 0: the largest adapter rank
    enable_cuda_graph: bool = True
    fp8_rollout: bool = False
    extra_args: list[str] = field(default_factory=list)
    embedded_max_params_b: float = 1.0  # the CPU engine holds fp32 weights: ~4 GB per billion
    startup_timeout_s: float = 600.0
    # The embedded engine's request limits (--max-n, --max-batch-size; SGLang has no such flags): the most samples
    # per prompt (n), and outputs (prompts x n), one /generate or chat request may ask for; more is a 400.
    max_n: int = 256
    max_batch_size: int = 4096


@dataclass(frozen=True)
class RouterConfig:
    kind: str = "none"
    policy: str = "auto"  # auto: manual with sessions (sticky by routing key), else round_robin
    port: Port = AUTO_PORT
    metrics_port: Port = AUTO_PORT  # its Prometheus exporter, bound to loopback too


@dataclass(frozen=True)
class SessionConfig:
    version: str = "off"
    host: str = "127.0.0.1"
    port: Port = AUTO_PORT
    tito_model: str = "default"
    message_matcher: str = "strict"
    max_trim_tokens: int = 1
    upstream_timeout_s: float = 600.0
    max_sessions: int = 1024  # open sessions at most: one more is a 429 (a rollout opens one per episode)
    max_age_s: float = 3600.0  # a session older than this is gone (404), its in-flight turn aborted


@dataclass(frozen=True)
class RolloutConfig:
    task: str = "arith"
    reward: str = "exact_match"
    agent: str = "feedback_loop"  # agentic (session) runs: the agent plug-in that plays each episode
    data: str = ""  # a prompt file for data-set tasks (task=jsonl)
    rollout_batch_size: int = 8  # prompts per step
    n_samples_per_prompt: int = 4
    max_response_len: int = 32
    max_turns: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    schedule: str = "sync"  # sync: train.py; async: train_async.py (one step stale)
    fully_async: bool = False
    max_weight_staleness: int = 0
    partial_rollout: bool = False
    group_rm: bool = False
    recompute_logprobs_via_prefill: bool = False
    routing_replay: bool = False  # R3: replay rollout MoE routing in training
    indexer_replay: bool = False


@dataclass(frozen=True)
class WeightSyncConfig:
    pause_generation_mode: str = "retract"
    transfer_mode: str = "broadcast"
    update_weights_interval: int = 1  # push the adapter after every N training steps, and after the last one
    check_weight_equal: bool = False
    # Right after each push every engine scores a fixed probe under the pushed adapter, and its mean
    # |trainer - engine| logprob must stay within max_logprob_gap before the trainer trains further
    # (weight_sync/probe.py). None: on, for every driver and multi-LoRA.
    verify: bool | None = None
    max_logprob_gap: float | None = None  # None: by engine kind (plan.model.DEFAULT_MAX_LOGPROB_GAP)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True
    cpu_offload: bool = False


@dataclass(frozen=True)
class AlgorithmConfig:
    advantage_estimator: str = "grpo"
    num_steps: int = 40
    global_batch_size: int = 0  # 0: one optimizer step per rollout (prompts x samples)
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    # The KL to the reference (the base model): a loss term for grpo/gspo (miles' kl_loss_coef), a per-token
    # reward penalty for the reinforce_plus_plus estimators (miles' kl_coef).
    kl_coef: float = 0.0
    gamma: float = 1.0  # reinforce_plus_plus: discount of the per-token returns
    entropy_coef: float = 0.0
    normalize_advantages_by_std: bool = True
    use_tis: bool = False
    use_rollout_logprobs: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 10  # steps; 0 turns periodic checkpoints off
    keep_last: int = 2


@dataclass(frozen=True)
class ExecutorConfig:
    kind: str = "local"
    ray_address: str = ""  # empty: start a local Ray on loopback
    health_timeout_s: float = 120.0
    # Times the driver may restart each engine that died mid-run: the restarted engine gets every live adapter
    # again (single-adapter runs: the last push, and the interrupted rollout runs again). 0: a dead engine ends the run.
    engine_restarts: int = 0


@dataclass(frozen=True)
class LoggerConfig:
    wandb_mode: str = "offline"
    project: str = "miles-runner"
    run_name: str = ""
    tags: list[str] = field(default_factory=list)
    metrics_jsonl: bool = True
    plots: bool = True
    progress: str = "auto"


@dataclass(frozen=True)
class SecurityConfig:
    # The NAME of the environment variable that holds the run's key ("" : no key, loopback only). Every server of
    # the run requires it as a bearer token and every client sends it; plan.yaml records the name, never the value.
    api_key_env: str = ""


@dataclass(frozen=True)
class MilesConfig:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    adapters: AdaptersConfig = field(default_factory=AdaptersConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)


def defaults_tree() -> dict[str, Any]:
    """The full default tree as plain data: the base that Hydra composes everything onto."""
    return asdict(MilesConfig())


def lookup(cfg: MilesConfig, path: str) -> Any:
    """The value at a dotted path such as `adapters.runs[1].rank`; None where any part is missing."""
    value: Any = cfg
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        value = value[int(part[1:-1])] if part.startswith("[") else getattr(value, part, None)
        if value is None:
            return None
    return value
