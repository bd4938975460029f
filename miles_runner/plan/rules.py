"""Every cross-field rule, each a small function over the config and its derived values.

A rule yields Findings: the keys involved (dotted paths; the compiler shows each with its value and origin),
why the combination cannot work, and an override that fixes it. compile_plan runs all of them and reports
every finding at once. Rule ids are stable: tests and users refer to them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from miles_runner.config.loader import did_you_mean
from miles_runner.config.schema import MilesConfig, lookup
from miles_runner.core.adapters import adapter_name_problem
from miles_runner.core.targets import ALL_ALIASES, KNOWN_MODULES, is_known_module
from miles_runner.plan.derive import (
    BUNDLED_DATA,
    BUNDLED_SCHEME,
    Derived,
    adapter_value,
    min_groups_per_dp_split,
    resolve_data_path,
    resolved_targets,
)
from miles_runner.plugins.lookup import registered
from miles_runner.plugins.tasks import TASKS


@dataclass(frozen=True)
class Finding:
    keys: tuple[str, ...]
    reason: str
    fix: str = ""


RuleFn = Callable[[MilesConfig, Derived], Iterator[Finding]]
RULES: dict[str, RuleFn] = {}
# Rules whose failure makes the others meaningless (they divide by these sizes): checked first, alone.
PRECONDITIONS: dict[str, RuleFn] = {}


def rule(rule_id: str, *, precondition: bool = False) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        (PRECONDITIONS if precondition else RULES)[rule_id] = fn
        return fn

    return register


POSITIVE_SIZES = (
    "cluster.nodes", "trainer.parallel.tp", "trainer.parallel.pp", "trainer.parallel.cp", "trainer.parallel.ep",
    "trainer.parallel.etp", "trainer.parallel.micro_batch_size", "engine.tp_size", "engine.ep_size",
)
NON_NEGATIVE_SIZES = (
    "cluster.gpus_per_node", "cluster.cpu_slots_per_node", "topology.actor_num_nodes",
    "topology.actor_num_gpus_per_node", "topology.rollout_num_gpus", "algorithm.global_batch_size",
    "adapters.max_slots", "engine.max_lora_rank", "executor.engine_restarts",
)


@rule("sizes-positive", precondition=True)
def sizes_positive(cfg: MilesConfig, d: Derived | None) -> Iterator[Finding]:
    for key in POSITIVE_SIZES + NON_NEGATIVE_SIZES:
        value, least = lookup(cfg, key), 1 if key in POSITIVE_SIZES else 0
        if value < least:
            yield Finding((key,), f"{key} is a count (of processes, GPUs, samples or restarts); it must be at least "
                          f"{least}.", f"{key}={least}")
    if cfg.cluster.cpu_only and cfg.cluster.cpu_slots_per_node < 1:
        yield Finding(("cluster.cpu_slots_per_node",), "A cpu-only node needs at least one worker slot.",
                      "cluster.cpu_slots_per_node=1")


SESSION = "session.version"
PAUSE = "weight_sync.pause_generation_mode"
TOPOLOGY = "topology.kind"
ADAPTERS = "adapters.kind"
LORA_MODE = "lora.mode"
BACKEND = "trainer.backend"

# ---- session server and pause mode (spec §1.2 rules 1-6) ----


@rule("session-needs-resumable-pause")
def session_needs_resumable_pause(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and cfg.weight_sync.pause_generation_mode == "abort":
        yield Finding(
            (SESSION, PAUSE),
            "An agent's turn in flight would be killed at every weight update. Use in_place or retract.",
            "pause_generation_mode=in_place",
        )


@rule("session-v2-returns-sample-lists")
def session_v2_returns_sample_lists(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "v2":
        return
    for key in ("group_rm", "partial_rollout", "recompute_logprobs_via_prefill"):
        if getattr(cfg.rollout, key):
            yield Finding(
                (SESSION, f"rollout.{key}"),
                f"The v2 session server returns a list of samples per session, which {key} cannot handle.",
                f"rollout.{key}=false",
            )


@rule("tito-model-needs-session")
def tito_model_needs_session(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.tito_model != "default" and cfg.session.version == "off":
        yield Finding(
            ("session.tito_model", SESSION),
            "A TITO model family only shapes how the session server tokenizes turns; there is no session server.",
            "session=v1",
        )


@rule("session-needs-adapter-on-engines")
def session_needs_adapter_on_engines(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.session.version != "off" and d.lora_enabled and cfg.adapters.train_only:
        yield Finding(
            (SESSION, "adapters.train_only"),
            "The session server attaches the adapter to every turn, but train_only never loads it on the engines.",
            "adapters.train_only=false",
        )


# ---- fully-async and drivers (rules 7-8) ----


@rule("fully-async-needs-disaggregated")
def fully_async_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and d.colocated:
        yield Finding(
            ("rollout.fully_async", TOPOLOGY),
            "Fully-async rollout keeps generating while training runs; colocated roles take turns on the GPUs.",
            "topology=disaggregated",
        )


@rule("fully-async-needs-resumable-pause")
def fully_async_needs_resumable_pause(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and cfg.weight_sync.pause_generation_mode == "abort":
        yield Finding(
            ("rollout.fully_async", PAUSE),
            "Every weight update would abort the generation that fully-async exists to keep running.",
            "pause_generation_mode=retract",
        )


@rule("fully-async-single-adapter")
def fully_async_single_adapter(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and d.multi_lora:
        yield Finding(
            ("rollout.fully_async", ADAPTERS),
            "Multi-LoRA has its own asynchronous producer; the fully-async rollout cannot drive it.",
            "rollout.fully_async=false",
        )


@rule("fully-async-no-partial-rollout")
def fully_async_no_partial_rollout(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.rollout.fully_async:
        return
    for key in ("partial_rollout", "recompute_logprobs_via_prefill"):
        if getattr(cfg.rollout, key):
            yield Finding(
                ("rollout.fully_async", f"rollout.{key}"),
                f"The fully-async rollout function does not support {key}.",
                f"rollout.{key}=false",
            )


@rule("fully-async-needs-async-driver")
def fully_async_needs_async_driver(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.fully_async and cfg.rollout.driver != "async":
        yield Finding(
            ("rollout.fully_async", "rollout.driver"),
            "Fully-async rollout runs only under the asynchronous driver (train_async).",
            "rollout.driver=async",
        )


@rule("async-driver-needs-disaggregated")
def async_driver_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.driver == "async" and d.colocated:
        yield Finding(
            ("rollout.driver", TOPOLOGY),
            "The async driver generates step n+1 while training step n; colocated roles cannot run at once.",
            "topology=disaggregated",
        )


@rule("async-needs-off-policy-correction")
def async_needs_off_policy_correction(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    a = cfg.algorithm
    if cfg.rollout.driver == "async" and not (a.use_rollout_logprobs or a.use_tis or cfg.trainer.keep_old_actor):
        yield Finding(
            ("rollout.driver", "algorithm.use_tis"),
            "Async samples come from weights one step old; the loss needs rollout logprobs, TIS or the old actor.",
            "algorithm.use_tis=true",
        )


@rule("async-driver-is-one-step-stale")
def async_driver_is_one_step_stale(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.driver == "async" and cfg.rollout.max_weight_staleness < 1:
        yield Finding(
            ("rollout.driver", "rollout.max_weight_staleness"),
            "The async driver trains on samples one weight version old; staleness 0 would reject every batch.",
            "rollout.max_weight_staleness=1",
        )


# ---- offload, optimizer storage (rules 9-15) ----


@rule("disk-offload-needs-megatron")
def disk_offload_needs_megatron(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.offload_target != "disk":
        return
    if cfg.trainer.backend != "megatron":
        yield Finding(
            ("trainer.offload_target", BACKEND),
            "Offloading training state to disk is implemented by the Megatron backend only.",
            "trainer.offload_target=cpu",
        )
    if not d.offload_train:
        yield Finding(
            ("trainer.offload_target", "topology.offload_train"),
            "A disk offload target needs training offload to be on.",
            "topology.offload_train=true",
        )


@rule("streamed-optimizer-state-rejects-lora")
def streamed_optimizer_state_rejects_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.stream_optimizer_state_to_disk and d.lora_enabled:
        yield Finding(
            ("trainer.stream_optimizer_state_to_disk", ADAPTERS),
            "The LoRA checkpoint saves the optimizer state, which the disk stream leaves empty.",
            "trainer.stream_optimizer_state_to_disk=false",
        )


@rule("rematerialize-rejects-lora")
def rematerialize_rejects_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.rematerialize_param_from_master_weight and d.lora_enabled:
        yield Finding(
            ("trainer.rematerialize_param_from_master_weight", ADAPTERS),
            "Rematerializing parameters from master weights is not implemented for LoRA adapters.",
            "trainer.rematerialize_param_from_master_weight=false",
        )


# ---- weight transfer (rules 16-17) ----


@rule("lora-sync-needs-broadcast")
def lora_sync_needs_broadcast(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode = cfg.weight_sync.transfer_mode
    if d.lora_enabled and mode in ("p2p", "disk-delta"):
        yield Finding(
            ("weight_sync.transfer_mode", ADAPTERS),
            f"LoRA weight sync is not implemented for {mode}: adapters go by tensor handoff or broadcast.",
            "weight_sync.transfer_mode=broadcast",
        )


@rule("transfer-mode-needs-disaggregated")
def transfer_mode_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode = cfg.weight_sync.transfer_mode
    if d.colocated and mode in ("p2p", "disk-delta"):
        yield Finding(
            ("weight_sync.transfer_mode", TOPOLOGY),
            f"{mode} transfers weights to engines on other GPUs; colocated engines share the trainer's.",
            "weight_sync.transfer_mode=broadcast",
        )


# ---- LoRA modes and targets (rules 18-25) ----


@rule("lora-mode-needs-adapters")
def lora_mode_needs_adapters(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.lora.mode != "none" and not d.lora_enabled:
        yield Finding(
            (LORA_MODE, ADAPTERS),
            "A LoRA mode without adapters trains nothing LoRA-shaped; full-weight training is lora_mode=none.",
            "lora_mode=none",
        )


@rule("adapters-need-lora-mode")
def adapters_need_lora_mode(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and cfg.lora.mode == "none":
        fix = "lora_mode=bridge" if cfg.trainer.backend == "megatron" else "lora_mode=peft"
        yield Finding((ADAPTERS, LORA_MODE), "Adapters are configured but no LoRA implementation is chosen.", fix)


@rule("lora-mode-matches-trainer")
def lora_mode_matches_trainer(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    mode, backend = cfg.lora.mode, cfg.trainer.backend
    if mode in ("bridge", "raw") and backend != "megatron":
        yield Finding((LORA_MODE, BACKEND), f"lora_mode={mode} is a Megatron path.", "lora_mode=peft")
    if mode == "peft" and backend != "fsdp":
        yield Finding((LORA_MODE, BACKEND), "lora_mode=peft is the FSDP trainer's path.", "lora_mode=bridge")


@rule("raw-lora-needs-native-model")
def raw_lora_needs_native_model(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.lora.mode == "raw" and d.lora_enabled and not cfg.model.native_lora:
        yield Finding(
            (LORA_MODE, "model.native_lora"),
            f"{cfg.model.name} has no native LoRA; raw mode would silently attach no adapter.",
            "lora_mode=bridge",
        )


@rule("disaggregated-lora-needs-bridge")
def disaggregated_lora_needs_bridge(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not d.colocated and cfg.lora.mode == "raw":
        yield Finding(
            (TOPOLOGY, LORA_MODE),
            "Broadcasting an adapter to separate engines needs the bridge export; raw LoRA syncs colocated only.",
            "lora_mode=bridge",
        )


@rule("disaggregated-lora-needs-pp1")
def disaggregated_lora_needs_pp1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not d.colocated and cfg.trainer.parallel.pp > 1:
        yield Finding(
            (TOPOLOGY, "trainer.parallel.pp"),
            "With pipeline stages no single rank holds the full adapter to broadcast.",
            "trainer.parallel.pp=1",
        )


@rule("ppo-critic-rejects-bridge")
def ppo_critic_rejects_bridge(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.algorithm.advantage_estimator == "ppo" and cfg.lora.mode == "bridge":
        yield Finding(
            ("algorithm.advantage_estimator", LORA_MODE),
            "The PPO critic cannot be built through the bridge LoRA path.",
            "algorithm.advantage_estimator=grpo",
        )


@rule("lora-rank-positive")
def lora_rank_positive(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and cfg.adapters.rank <= 0:
        yield Finding(("adapters.rank",), "A LoRA adapter needs a rank of at least 1.", "adapters.rank=16")
    if d.lora_enabled and cfg.adapters.alpha <= 0:
        yield Finding(("adapters.alpha",), "LoRA alpha scales the update and must be positive.", "adapters.alpha=32")


@rule("lora-targets-required")
def lora_targets_required(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.lora_enabled and not cfg.adapters.target_modules:
        yield Finding(
            ("adapters.target_modules",),
            "'target_modules' is required when LoRA is enabled: it says which layers get adapters.",
            "adapters.target_modules=[all-linear]",
        )
    elif d.lora_enabled and not d.target_modules:
        yield Finding(
            ("adapters.target_modules", "adapters.exclude_modules"),
            "The exclusions remove every target module; the adapter would be empty.",
            "adapters.exclude_modules=[]",
        )


@rule("lora-target-unknown")
def lora_target_unknown(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.lora_enabled:
        return
    for name in cfg.adapters.target_modules:
        if not is_known_module(name):
            hint = did_you_mean(name, sorted(KNOWN_MODULES) + list(ALL_ALIASES))
            yield Finding(
                ("adapters.target_modules",),
                f"'{name}' is not a linear module name a model defines; {hint or 'use all-linear or HF names'}",
                "adapters.target_modules=[all-linear]",
            )


# ---- multi-LoRA (rules 26-29) ----


def _multi(fn: RuleFn) -> RuleFn:
    def wrapped(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
        if d.multi_lora:
            yield from fn(cfg, d)

    return wrapped


@rule("multi-lora-needs-disaggregated")
@_multi
def multi_lora_needs_disaggregated(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.colocated:
        yield Finding(
            (ADAPTERS, TOPOLOGY),
            "Multi-LoRA adapters reach the engines only by broadcast to engines that keep running "
            "(disaggregated).",
            "topology=disaggregated",
        )


@rule("multi-lora-needs-slotted-lora")
@_multi
def multi_lora_needs_slotted_lora(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.lora.mode not in ("bridge", "peft"):
        yield Finding(
            (ADAPTERS, LORA_MODE),
            "Per-adapter slots exist in the bridge PEFT path (Megatron) and the peft path (FSDP) only.",
            "lora_mode=bridge" if cfg.trainer.backend == "megatron" else "lora_mode=peft",
        )


@rule("multi-lora-needs-pp1")
@_multi
def multi_lora_needs_pp1(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.parallel.pp > 1:
        yield Finding(
            (ADAPTERS, "trainer.parallel.pp"),
            "No pipeline rank holds a full adapter, and a pipelined recompute would use another "
            "micro-batch's routing.",
            "trainer.parallel.pp=1",
        )


@rule("multi-lora-needs-adam")
@_multi
def multi_lora_needs_adam(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.optimizer.name != "adam":
        yield Finding(
            (ADAPTERS, "optimizer.name"),
            "Per-slot optimizer state (and its reset when a slot is reused) is implemented for Adam only.",
            "optimizer.name=adam",
        )


@rule("multi-lora-needs-thd")
@_multi
def multi_lora_needs_thd(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.backend == "megatron" and cfg.trainer.parallel.qkv_format != "thd":
        yield Finding(
            (ADAPTERS, "trainer.parallel.qkv_format"),
            "Per-adapter token spans need contiguous (thd) packing.",
            "trainer.parallel.qkv_format=thd",
        )


@rule("multi-lora-keeps-gradients-resident")
@_multi
def multi_lora_keeps_gradients_resident(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.offload_train:
        yield Finding(
            (ADAPTERS, "topology.offload_train"),
            "Per-adapter gradients stay in device buffers between train calls; training offload would drop them.",
            "topology.offload_train=false",
        )


@rule("multi-lora-no-shared-outer-experts")
@_multi
def multi_lora_no_shared_outer_experts(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.adapters.experts_shared_outer:
        yield Finding(
            (ADAPTERS, "adapters.experts_shared_outer"),
            "Shared-outer expert LoRA has no per-slot layout.",
            "adapters.experts_shared_outer=false",
        )


@rule("multi-lora-per-adapter-loss")
@_multi
def multi_lora_per_adapter_loss(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.trainer.calculate_per_token_loss:
        yield Finding(
            (ADAPTERS, "trainer.calculate_per_token_loss"),
            "The loss is normalised per adapter batch; a per-token loss would mix adapters.",
            "trainer.calculate_per_token_loss=false",
        )


@rule("multi-lora-needs-adapters")
@_multi
def multi_lora_needs_adapters(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.adapters.runs and not cfg.adapters.service_mode:
        yield Finding(
            ("adapters.runs", "adapters.service_mode"),
            "A bounded multi-LoRA run with no adapters has nothing to train.",
            "adapters.service_mode=true",
        )
    if d.multi_lora_slots < 1 and cfg.adapters.service_mode:
        yield Finding(
            ("adapters.max_slots", "adapters.service_mode"),
            "A multi-LoRA service with no configured adapters needs engine slots for the ones that will register.",
            "adapters.max_slots=4",
        )
    if cfg.adapters.max_slots and len(cfg.adapters.runs) > cfg.adapters.max_slots:
        yield Finding(
            ("adapters.runs", "adapters.max_slots"),
            f"{len(cfg.adapters.runs)} adapters do not fit in {cfg.adapters.max_slots} engine slots.",
            f"adapters.max_slots={len(cfg.adapters.runs)}",
        )


@rule("adapter-names-unique-and-safe")
def adapter_names_unique_and_safe(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not d.multi_lora:
        return
    counts = Counter(run.name for run in cfg.adapters.runs)
    for i, run in enumerate(cfg.adapters.runs):
        if problem := adapter_name_problem(run.name):
            yield Finding((f"adapters.runs[{i}].name",), f"Adapter names become folders and rid prefixes: {problem}.")
        elif counts[run.name] > 1:
            yield Finding((f"adapters.runs[{i}].name",), f"'{run.name}' names more than one adapter.")


@rule("adapter-fits-engine")
@_multi
def adapter_fits_engine(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    served = set(d.target_modules)
    for i, run in enumerate(cfg.adapters.runs):
        rank = adapter_value(run, "rank", cfg)
        if rank <= 0 or rank > d.max_lora_rank:
            yield Finding(
                (f"adapters.runs[{i}].rank", "engine.max_lora_rank"),
                f"Adapter '{run.name}' has rank {rank}; engines serve ranks 1..{d.max_lora_rank}.",
                f"engine.max_lora_rank={rank}" if rank > 0 else f"++adapters.runs.{i}.rank=1",
            )
        extra = [m for m in resolved_targets(cfg, adapter_value(run, "target_modules", cfg)) if m not in served]
        if extra:
            yield Finding(
                (f"adapters.runs[{i}].target_modules", "adapters.target_modules"),
                f"Adapter '{run.name}' targets {extra}, which the engines are not launched to serve.",
                "adapters.target_modules=[all-linear]",
            )


@rule("adapter-batch-shape")
@_multi
def adapter_batch_shape(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    cap = 4 * d.global_batch_size
    for i, run in enumerate(cfg.adapters.runs):
        rbs = adapter_value(run, "rollout_batch_size", cfg)
        n = adapter_value(run, "n_samples_per_prompt", cfg)
        keys = (f"adapters.runs[{i}].rollout_batch_size", f"adapters.runs[{i}].n_samples_per_prompt")
        if rbs < 1 or n < 1:
            yield Finding(keys, f"Adapter '{run.name}' needs at least one prompt and one sample per prompt.")
            continue
        if rbs * n > cap:
            yield Finding(keys, f"Adapter '{run.name}': {rbs}x{n} samples exceed the cap of 4 x global batch ({cap}).")
        split = min_groups_per_dp_split(n, d.dp_size)
        if d.dp_size and split is None:
            yield Finding(keys, f"Adapter '{run.name}': {n} samples per prompt and DP {d.dp_size} do not divide.")
        elif split and rbs % split:
            reason = f"Adapter '{run.name}': {rbs} prompts is not a multiple of {split} groups per DP split."
            yield Finding(keys, reason)


# ---- plug-ins (by registered name only: a config never names code to import) ----


def _plugin_uses(cfg: MilesConfig, d: Derived) -> list[tuple[str, str, str]]:
    uses = [("rollout.task", cfg.rollout.task, "task"), ("rollout.reward", cfg.rollout.reward, "reward")]
    if cfg.session.version != "off":
        uses.append(("rollout.agent", cfg.rollout.agent, "agent"))
    if d.multi_lora:
        for i, run in enumerate(cfg.adapters.runs):
            item = f"adapters.runs[{i}]"
            uses += [(f"{item}.task", run.task, "task"), (f"{item}.reward", run.reward, "reward")]
            if run.agent is not None:
                uses.append((f"{item}.agent", run.agent, "agent"))
    return uses


@rule("plugins-registered")
def plugins_registered(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    names = registered()
    for key, value, kind in _plugin_uses(cfg, d):
        if value not in names[kind]:
            known = ", ".join(names[kind])
            hint = did_you_mean(value, names[kind])
            fix_key = key if "[" not in key else "++" + key.replace("[", ".").replace("]", "")
            yield Finding(
                (key,),
                f"No {kind} is registered as '{value}'{'; ' + hint if hint else ''} (registered: {known}).",
                f"{fix_key}={hint.split(chr(39))[1] if hint else names[kind][0]}",
            )


@rule("dataset-task-needs-data")
def dataset_task_needs_data(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    def needs_data(task: str) -> bool:
        return task in TASKS and TASKS.get(task).needs_data

    if needs_data(cfg.rollout.task) and not cfg.rollout.data:
        yield Finding(("rollout.task", "rollout.data"), f"Task {cfg.rollout.task} reads its prompts from a file.",
                      "rollout.data=/path/to/prompts.jsonl")
    for i, run in enumerate(cfg.adapters.runs if d.multi_lora else []):
        if needs_data(run.task) and not run.data:
            yield Finding((f"adapters.runs[{i}].task", f"adapters.runs[{i}].data"),
                          f"Adapter '{run.name}' task {run.task} reads its prompts from a file.",
                          f"++adapters.runs.{i}.data=/path/to/prompts.jsonl")
    named = [("rollout.data", "rollout.data", cfg.rollout.data)]
    named += [(f"adapters.runs[{i}].data", f"++adapters.runs.{i}.data", run.data)
              for i, run in enumerate(cfg.adapters.runs if d.multi_lora else [])]
    for key, override, path in named:
        if path.startswith(BUNDLED_SCHEME) and not Path(resolve_data_path(path)).is_file():
            shipped = sorted(f.name for f in BUNDLED_DATA.glob("*.jsonl"))
            yield Finding((key,), f"No prompt set {path.removeprefix(BUNDLED_SCHEME)!r} is bundled; the package "
                          f"ships {shipped}.", f"{override}={BUNDLED_SCHEME}{shipped[0]}")


# ---- routing replay ----


@rule("routing-replay-needs-moe")
def routing_replay_needs_moe(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.rollout.routing_replay and not d.is_moe:
        yield Finding(
            ("rollout.routing_replay", "model.num_experts"),
            f"{cfg.model.name} is dense: there is no expert routing to replay.",
            "rollout.routing_replay=false",
        )


@rule("indexer-replay-needs-dsa")
def indexer_replay_needs_dsa(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.rollout.indexer_replay:
        return
    if not cfg.model.has_dsa_indexer:
        yield Finding(
            ("rollout.indexer_replay", "model.has_dsa_indexer"),
            f"{cfg.model.name} has no sparse-attention indexer whose top-k could be replayed.",
            "rollout.indexer_replay=false",
        )
    if cfg.trainer.parallel.cp != 1:
        yield Finding(
            ("rollout.indexer_replay", "trainer.parallel.cp"),
            "Indexer replay needs the whole sequence on one rank.",
            "trainer.parallel.cp=1",
        )


# ---- cluster and arithmetic ----


@rule("cpu-cluster-runs-no-gpu-components")
def cpu_cluster_runs_no_gpu_components(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if not cfg.cluster.cpu_only:
        return
    if cfg.engine.kind == "sglang":
        yield Finding(
            ("engine.kind", "cluster.cpu_only"),
            "SGLang servers need CUDA GPUs; a cpu-only cluster runs the embedded engine.",
            "engine=embedded",
        )
    if cfg.trainer.backend == "megatron":
        yield Finding(
            (BACKEND, "cluster.cpu_only"),
            "The Megatron trainer needs CUDA GPUs; a cpu-only cluster trains with FSDP.",
            "trainer=fsdp lora_mode=peft",
        )


@rule("gpu-cluster-needs-gpus", precondition=True)
def gpu_cluster_needs_gpus(cfg: MilesConfig, d: Derived | None) -> Iterator[Finding]:
    if not cfg.cluster.cpu_only and cfg.cluster.gpus_per_node <= 0:
        yield Finding(
            ("cluster.gpus_per_node", "cluster.cpu_only"),
            "A GPU cluster needs at least one GPU per node.",
            "cluster.gpus_per_node=8",
        )


@rule("embedded-engine-model-too-large")
def embedded_engine_model_too_large(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind == "embedded" and cfg.model.params_b > cfg.engine.embedded_max_params_b:
        yield Finding(
            ("engine.kind", "model.params_b"),
            f"The embedded CPU engine serves up to {cfg.engine.embedded_max_params_b}B parameters; "
            f"{cfg.model.name} has {cfg.model.params_b}B.",
            "model=tiny_moe" if cfg.cluster.cpu_only else "engine=sglang",
        )


@rule("embedded-engine-is-one-process")
def embedded_engine_is_one_process(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.engine.kind == "embedded" and (cfg.engine.tp_size != 1 or cfg.engine.ep_size != 1):
        yield Finding(
            ("engine.kind", "engine.tp_size", "engine.ep_size"),
            "The embedded engine is a single process: it has no tensor or expert parallelism.",
            "engine.tp_size=1 engine.ep_size=1",
        )


@rule("fsdp-has-no-model-parallelism")
def fsdp_has_no_model_parallelism(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    p = cfg.trainer.parallel
    if cfg.trainer.backend == "fsdp":
        for key in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(p, key) != 1:
                yield Finding(
                    (BACKEND, f"trainer.parallel.{key}"),
                    "The FSDP trainer shards data-parallel only; model parallelism is Megatron's.",
                    f"trainer.parallel.{key}=1",
                )


@rule("trainer-fits-cluster")
def trainer_fits_cluster(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    t = cfg.topology
    if t.actor_num_nodes > cfg.cluster.nodes:
        yield Finding(
            ("topology.actor_num_nodes", "cluster.nodes"),
            f"The trainer asks for {t.actor_num_nodes} nodes; the cluster has {cfg.cluster.nodes}.",
            f"topology.actor_num_nodes={cfg.cluster.nodes}",
        )
    if d.trainer_gpus_per_node > d.slots_per_node:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "cluster.gpus_per_node"),
            f"The trainer asks for {d.trainer_gpus_per_node} GPUs per node; nodes have {d.slots_per_node}.",
            f"topology.actor_num_gpus_per_node={d.slots_per_node}",
        )


def largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, max(min(n, at_most), 1) + 1) if n % k == 0)


def shrink_factor(world: int, factors: dict[str, int]) -> str:
    """An override that makes the product of `factors` divide `world`: the first non-1 factor that can be
    lowered to a divisor of what the others leave."""
    for name, value in factors.items():
        rest = 1
        for other, v in factors.items():
            rest *= v if other != name else 1
        if value > 1 and world % rest == 0:
            return f"trainer.parallel.{name}={largest_divisor(world // rest, value)}"
    return " ".join(f"trainer.parallel.{name}=1" for name, value in factors.items() if value > 1)


@rule("world-size-divisible-by-model-parallel")
def world_size_divisible(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    p, world = cfg.trainer.parallel, d.trainer_world_size
    if world % d.model_parallel:
        yield Finding(
            ("trainer.parallel.tp", "trainer.parallel.pp", "trainer.parallel.cp", "topology.actor_num_gpus_per_node"),
            f"{world} trainer GPUs cannot be split into TP {p.tp} x PP {p.pp} x CP {p.cp} groups.",
            shrink_factor(world, {"pp": p.pp, "cp": p.cp, "tp": p.tp}),
        )
    if world % (p.ep * p.etp * p.pp):
        yield Finding(
            ("trainer.parallel.ep", "trainer.parallel.etp", "topology.actor_num_gpus_per_node"),
            f"{world} trainer GPUs cannot be split into EP {p.ep} x ETP {p.etp} x PP {p.pp} groups.",
            shrink_factor(world, {"ep": p.ep, "etp": p.etp, "pp": p.pp}),
        )


@rule("expert-parallel-divides-experts")
def expert_parallel_divides_experts(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    experts = cfg.model.num_experts
    for key, ep in (("trainer.parallel.ep", cfg.trainer.parallel.ep), ("engine.ep_size", cfg.engine.ep_size)):
        if ep > 1 and (experts == 0 or experts % ep):
            yield Finding(
                (key, "model.num_experts"),
                f"EP {ep} must divide the model's {experts} experts evenly.",
                f"{key}=1",
            )


@rule("engines-fit-rollout-gpus")
def engines_fit_rollout_gpus(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    tp = cfg.engine.tp_size
    if tp <= 0 or d.rollout_gpus % tp or d.num_engines == 0:
        yield Finding(
            ("engine.tp_size", "topology.rollout_num_gpus"),
            f"{d.rollout_gpus} rollout GPUs cannot host whole engines of TP {tp}.",
            f"engine.tp_size={largest_divisor(d.rollout_gpus, min(tp, d.slots_per_node))}"
            if d.rollout_gpus
            else "topology.rollout_num_gpus=1",
        )
    elif tp > d.slots_per_node and tp % d.slots_per_node:
        yield Finding(
            ("engine.tp_size", "cluster.gpus_per_node"),
            f"An engine of TP {tp} must use whole nodes of {d.slots_per_node} GPUs.",
            f"engine.tp_size={largest_divisor(d.rollout_gpus, d.slots_per_node)}",
        )


@rule("cluster-holds-plan")
def cluster_holds_plan(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.colocated:
        return
    left = d.total_slots - d.trainer_world_size
    shrink_trainer = f"topology.actor_num_gpus_per_node={max(d.trainer_gpus_per_node // 2, 1)}"
    if d.trainer_world_size + d.rollout_gpus > d.total_slots:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "topology.rollout_num_gpus", "cluster.nodes"),
            f"Trainer ({d.trainer_world_size}) + rollout ({d.rollout_gpus}) GPUs exceed the cluster's "
            f"{d.total_slots}.",
            f"topology.rollout_num_gpus={left}" if left > 0 else shrink_trainer,
        )
    elif d.rollout_gpus == 0:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "topology.rollout_num_gpus"),
            "Disaggregated engines need GPUs of their own; the trainer takes them all.",
            shrink_trainer if d.trainer_gpus_per_node > 1 else "topology=colocated",
        )


@rule("engine-model-fits-memory")
def engine_model_fits_memory(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    c = cfg.cluster
    if c.cpu_only or c.gpu_memory_gb <= 0 or cfg.engine.tp_size <= 0:
        return
    bytes_per_param = 1 if cfg.engine.fp8_rollout else 2
    need = cfg.model.params_b * bytes_per_param / cfg.engine.tp_size
    have = c.gpu_memory_gb * cfg.engine.mem_fraction_static
    if need > have:
        yield Finding(
            ("engine.tp_size", "model.params_b", "cluster.gpu_memory_gb"),
            f"Each engine GPU would hold {need:.0f} GB of weights; {have:.0f} GB are available to SGLang.",
            f"engine.tp_size={cfg.engine.tp_size * 2}",
        )


@rule("local-executor-is-one-node")
def local_executor_is_one_node(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if cfg.executor.kind == "local" and cfg.cluster.nodes > 1:
        yield Finding(
            ("executor.kind", "cluster.nodes"),
            "The local executor starts processes on this machine only; several nodes need Ray.",
            "executor=ray",
        )


@rule("batch-arithmetic")
def batch_arithmetic(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    r = cfg.rollout
    for key in ("rollout_batch_size", "n_samples_per_prompt", "max_response_len", "max_turns"):
        if getattr(r, key) < 1:
            yield Finding((f"rollout.{key}",), f"rollout.{key} must be at least 1.", f"rollout.{key}=1")
    if cfg.algorithm.num_steps < 1:
        yield Finding(("algorithm.num_steps",), "A run needs at least one step.", "algorithm.num_steps=1")
    if r.max_weight_staleness < 0:
        key = "rollout.max_weight_staleness"
        yield Finding((key,), "Staleness is a count of weight versions.", f"{key}=0")
    gbs, samples = d.global_batch_size, r.rollout_batch_size * r.n_samples_per_prompt
    if d.dp_size and gbs % d.dp_size:
        yield Finding(
            ("algorithm.global_batch_size", "topology.actor_num_gpus_per_node"),
            f"A global batch of {gbs} samples does not split over DP {d.dp_size}.",
            f"algorithm.global_batch_size={fitting_global_batch(samples, d.dp_size)}",
        )
    if not d.multi_lora and gbs > 0 and samples % gbs:
        yield Finding(
            ("algorithm.global_batch_size", "rollout.rollout_batch_size", "rollout.n_samples_per_prompt"),
            f"Each rollout makes {samples} samples, not a whole number of global batches of {gbs}.",
            f"algorithm.global_batch_size={fitting_global_batch(samples, max(d.dp_size, 1))}",
        )
    if r.max_response_len > cfg.model.max_context_len:
        yield Finding(
            ("rollout.max_response_len", "model.max_context_len"),
            f"Responses of {r.max_response_len} tokens exceed the model's context of {cfg.model.max_context_len}.",
            f"rollout.max_response_len={cfg.model.max_context_len // 2}",
        )


def fitting_global_batch(samples: int, dp: int) -> int:
    """The largest global batch that divides a rollout's samples and splits over DP (else the samples)."""
    fits = [g for g in range(dp, samples + 1, dp) if samples % g == 0]
    return fits[-1] if fits else samples


@rule("ports-distinct")
def ports_distinct(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    first, last = cfg.engine.base_port, cfg.engine.base_port + d.num_engines - 1
    named = {
        "router.port": cfg.router.port if cfg.router.kind != "none" else None,
        "router.metrics_port": cfg.router.metrics_port if cfg.router.kind != "none" else None,
        "session.port": cfg.session.port if cfg.session.version != "off" else None,
        "adapters.api_port": cfg.adapters.api_port if d.multi_lora else None,
    }
    seen: dict[int, str] = {}
    for key, port in named.items():
        if port is None:
            continue
        other = "engine.base_port" if first <= port <= last else seen.get(port)
        if other:
            reason = f"Port {port} is used twice (engines use {first}..{last})."
            yield Finding((key, other), reason, f"{key}={port + 100}")
        seen[port] = key
