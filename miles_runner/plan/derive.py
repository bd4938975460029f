"""Values the plan derives and the user never sets (docs/system.md §1.2 "Adjustments"), as pure functions of the config.

Rules see these too, so a rule reads the same number the plan will use (e.g. the trainer's world size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.config.schema import AdapterEntry, MilesConfig
from miles_runner.core.adapters import LORA_ADAPTER_NAME, slot_lora_name
from miles_runner.core.paths import bundled_data_dir, model_cache_dir
from miles_runner.core.targets import expand_target_modules

TINY_SCHEME = "tiny:"
TINY_MODEL_SEED = 0


@dataclass(frozen=True)
class Derived:
    lora_enabled: bool
    lora_rollout_enabled: bool
    multi_lora: bool
    colocated: bool
    devices_per_node: int
    total_devices: int
    trainer_nodes: int
    trainer_gpus_per_node: int
    trainer_world_size: int
    rollout_gpus: int
    num_engines: int
    model_parallel: int  # tp * pp * cp
    dp_size: int  # 0 when the world size is not a multiple of tp*pp*cp
    offload_train: bool
    offload_rollout: bool
    use_addition_r3: bool
    router_policy: str
    transfer_mode: str
    flush_on_sync: bool
    target_modules: list[str]
    engine_lora_names: list[str]
    multi_lora_slots: int
    max_lora_rank: int
    global_batch_size: int
    max_adapter_global_batch_size: int  # the cap on one adapter's samples per step (4 global batches)
    normalize_std: bool
    is_moe: bool
    model_path: str


def derive(cfg: MilesConfig) -> Derived:
    lora_enabled = cfg.adapters.kind != "none"
    multi = cfg.adapters.kind == "multi"
    colocated = cfg.topology.kind == "colocated"
    devices_per_node = cfg.cluster.cpu_devices_per_node if cfg.cluster.cpu_only else cfg.cluster.gpus_per_node
    trainer_gpn = cfg.topology.actor_num_gpus_per_node or devices_per_node
    trainer_nodes = cfg.topology.actor_num_nodes or cfg.cluster.nodes
    world = trainer_nodes * trainer_gpn
    total = cfg.cluster.nodes * devices_per_node
    rollout_gpus = world if colocated else (cfg.topology.rollout_num_gpus or max(total - world, 0))
    par = cfg.trainer.parallel
    mp = par.tp * par.pp * par.cp
    # Colocated roles take turns on the GPUs, so each offloads while the other runs (miles' colocate default, on the
    # Megatron path). A CPU plan offloads only when asked: host memory is what the trainer shares anyway.
    offload_default = colocated and not multi and not cfg.cluster.cpu_only and cfg.trainer.backend == "megatron"
    slots = (cfg.adapters.max_slots or len(cfg.adapters.runs)) if multi else 0
    gbs = cfg.algorithm.global_batch_size or cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    return Derived(
        lora_enabled=lora_enabled,
        lora_rollout_enabled=lora_enabled and not cfg.adapters.train_only,
        multi_lora=multi,
        colocated=colocated,
        devices_per_node=devices_per_node,
        total_devices=total,
        trainer_nodes=trainer_nodes,
        trainer_gpus_per_node=trainer_gpn,
        trainer_world_size=world,
        rollout_gpus=rollout_gpus,
        num_engines=rollout_gpus // cfg.engine.tp_size if cfg.engine.tp_size > 0 else 0,
        model_parallel=mp,
        dp_size=world // mp if mp > 0 and world % mp == 0 else 0,
        offload_train=_or_default(cfg.topology.offload_train, offload_default),
        offload_rollout=_or_default(cfg.topology.offload_rollout, offload_default),
        use_addition_r3=(
            cfg.session.version != "off"
            and cfg.weight_sync.pause_generation_mode == "in_place"
            and cfg.rollout.routing_replay
        ),
        router_policy=router_policy(cfg),
        transfer_mode=transfer_mode(cfg),
        flush_on_sync=colocated or cfg.weight_sync.pause_generation_mode != "in_place",
        target_modules=resolved_targets(cfg, cfg.adapters.target_modules),
        engine_lora_names=engine_lora_names(cfg, slots),
        multi_lora_slots=slots,
        max_lora_rank=max_lora_rank(cfg),
        global_batch_size=gbs,
        max_adapter_global_batch_size=4 * gbs,
        # Only the group estimators divide by the group std (the REINFORCE++ ones whiten the whole batch instead).
        normalize_std=cfg.algorithm.normalize_advantages_by_std
        and (cfg.rollout.n_samples_per_prompt > 1 or multi)
        and cfg.algorithm.advantage_estimator in ("grpo", "gspo"),
        is_moe=cfg.model.num_experts > 0,
        model_path=resolve_model_path(cfg.model.path),
    )


def _or_default(value: bool | None, default: bool) -> bool:
    return default if value is None else value


def router_policy(cfg: MilesConfig) -> str:
    """Sessions must stick to one engine (their KV and in_place requests live there). The session server pins
    its turns itself (session/upstream.py); what it proxies through the router carries the session's key, which
    the manual policy keeps on one worker too."""
    if cfg.router.policy != "auto":
        return cfg.router.policy
    return "manual" if cfg.session.version != "off" else "round_robin"


def transfer_mode(cfg: MilesConfig) -> str:
    """Colocated engines share the trainer's GPUs: adapters go by tensor hand-off, whatever transfer_mode says."""
    if cfg.topology.kind == "colocated":
        return "tensor"
    return cfg.weight_sync.transfer_mode


def resolved_targets(cfg: MilesConfig, targets: list[str]) -> list[str]:
    return expand_target_modules(
        targets, cfg.adapters.exclude_modules, kv_lora_rank=cfg.model.kv_lora_rank, q_lora_rank=cfg.model.q_lora_rank
    )


def engine_lora_names(cfg: MilesConfig, slots: int) -> list[str]:
    if cfg.adapters.kind == "single":
        return [LORA_ADAPTER_NAME]
    return [slot_lora_name(k) for k in range(slots)]


def adapter_value(run: AdapterEntry, field: str, cfg: MilesConfig) -> Any:
    """A multi-LoRA run's own value, else the global default (docs/system.md §4.3 resolve_adapter_config)."""
    own = getattr(run, field)
    if own is not None and own != []:
        return own
    fallback = {
        "rank": cfg.adapters.rank,
        "alpha": cfg.adapters.alpha,
        "target_modules": cfg.adapters.target_modules,
        "lr": cfg.optimizer.lr,
        "rollout_batch_size": cfg.rollout.rollout_batch_size,
        "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
    }
    return fallback.get(field, own)


def adapter_values(cfg: MilesConfig, run: AdapterEntry) -> dict[str, Any]:
    """A configured adapter's resolved settings: its own values over the `adapters.*` defaults."""
    values = {key: adapter_value(run, key, cfg) for key in ADAPTER_FIELDS}
    return {**values, "target_modules": resolved_targets(cfg, values["target_modules"])}


ADAPTER_FIELDS = (
    "rank",
    "alpha",
    "target_modules",
    "lr",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "num_step",
    "num_epoch",
    "task",
    "reward",
    "agent",
)


def max_lora_rank(cfg: MilesConfig) -> int:
    if cfg.engine.max_lora_rank:
        return cfg.engine.max_lora_rank
    ranks: list[int] = [cfg.adapters.rank] + [adapter_value(r, "rank", cfg) for r in cfg.adapters.runs]
    return max(max(ranks), 1)


BUNDLED_SCHEME = "bundled:"
BUNDLED_DATA = bundled_data_dir()  # prompt sets shipped with the package


def resolve_data_path(path: str) -> str:
    """A prompt file for the plan: `bundled:NAME` -> the file shipped in miles_runner/plugins/data; a relative
    path -> absolute (servers run in the run folder); absolute paths and "" as they are."""
    if path.startswith(BUNDLED_SCHEME):
        return str(BUNDLED_DATA / path.removeprefix(BUNDLED_SCHEME))
    return absolute_path(path)


def absolute_path(path: str) -> str:
    """A file the servers read: they run in the run folder, so a relative path is made absolute; "" stays."""
    return str(Path(path).absolute()) if path else ""


def parse_tiny_model(path: str) -> tuple[str, bool] | None:
    """`tiny:NAME` (the seeded random model) or `tiny:NAME:format` (after format pre-training on the
    registered tasks, which gives LoRA something to steer) -> (NAME, pretrained); None for other paths."""
    if not path.startswith(TINY_SCHEME):
        return None
    name, _, variant = path.removeprefix(TINY_SCHEME).partition(":")
    return name, variant == "format"


def resolve_model_path(path: str) -> str:
    """A tiny model spec -> the folder in the user's cache (`<cache>/models`) its factory builds on first use;
    other paths as they are."""
    tiny = parse_tiny_model(path)
    if tiny is None:
        return path
    name, pretrained = tiny
    return str(model_cache_dir() / f"{name}-seed{TINY_MODEL_SEED}{'-format' if pretrained else ''}")
