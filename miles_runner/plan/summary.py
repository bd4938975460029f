"""Readable tables of a Plan: the facts a reviewer asks for before approving GPU time."""

from __future__ import annotations

import shlex

from miles_runner.core.cluster_nodes import node_resource
from miles_runner.core.sglang_protocol import SGLANG_VERSION, STOCK
from miles_runner.plan.model import (
    PORTS_FILE,
    Launch,
    Plan,
    engine_rank_name,
    node_host,
    plan_launches,
    server_launches,
)


def summarize(plan: Plan, plan_path: str) -> str:
    rows = [("cluster", cluster_line(plan))]
    if plan.cluster.nodes > 1:
        rows += [(f"node {k}", line) for k, line in enumerate(node_lines(plan))]
    rows += [
        ("trainer", trainer_line(plan)),
        ("algorithm", algorithm_line(plan)),
        ("engines", engines_line(plan)),
    ]
    if plan.router:
        rows.append(("router", f"sglang-router on :{plan.router.launch.port_label}, policy {plan.router.policy}"))
    rows.append(("rollout", rollout_line(plan)))
    if plan.session:
        rows.append(("session", session_line(plan)))
    if plan.multi_lora:
        m = plan.multi_lora
        names = ", ".join(a.name for a in plan.adapters) or "none yet"
        rows.append(("adapters", f"{len(plan.adapters)} of {m.slots} slots ({names}); API on :{m.launch.port_label}"))
    rows.append(("auth", auth_line(plan)))
    if any(launch.port_name for launch in plan_launches(plan)):
        rows.append(("ports", f"auto: chosen free at start where each server runs, recorded in RUN_DIR/{PORTS_FILE}"))
    rows += [
        ("sync", sync_line(plan)),
        *([("offload", offload_line(plan))] if plan.weight_sync.offload_tags else []),
        ("verify", verify_line(plan)),
        ("batches", batch_line(plan)),
        ("derived", derived_line(plan)),
    ]
    width = max(len(k) for k, _ in rows)
    head = f"plan {plan.name} -> {plan_path}"
    return "\n".join([head, *(f" {k:<{width}}  {v}" for k, v in rows), " commands", *command_lines(plan)])


def auth_line(plan: Plan) -> str:
    """How the run's servers authenticate: the key's variable, never its value."""
    if name := plan.security.api_key_env:
        return f"bearer key from ${name} (every server of the run requires it)"
    if plan.cluster.nodes > 1:
        return "none: the servers listen on the nodes' addresses unauthenticated (set security.api_key_env)"
    return "none (loopback only)"


def cluster_line(plan: Plan) -> str:
    c = plan.cluster
    if c.cpu_only:
        return f"{c.nodes} node{'s' * (c.nodes > 1)} x {c.devices_per_node} CPU devices (no GPU), {plan.topology}"
    return f"{c.nodes} nodes x {c.gpus_per_node} {c.gpu_type} ({c.total_devices} GPUs), {plan.topology}"


def node_lines(plan: Plan) -> list[str]:
    """What runs on each node of a plan that spans nodes, and where its address comes from."""
    on_node: list[list[str]] = [[] for _ in range(plan.cluster.nodes)]
    for rank, (node, _device) in enumerate(plan.trainer.placements):
        on_node[node].append("driver (trainer rank 0)" if rank == 0 else f"trainer rank {rank}")
    labels = engine_rank_labels(plan)
    for name, launch in server_launches(plan):
        on_node[launch.node].append(labels.get(name, name))
    return [
        f"{', '.join(names) or 'nothing'}; address {node_host(k)}: the Ray node offering {node_resource(k)}"
        for k, names in enumerate(on_node)
    ]


def engine_rank_labels(plan: Plan) -> dict[str, str]:
    """How a node names the node rank it runs of an engine wider than a node, by component name."""
    labels = {}
    for e in plan.engines:
        if e.node_ranks:
            labels[e.name] = f"{e.name} (node rank 0 of {len(e.nodes)})"
            labels |= {
                engine_rank_name(e.index, r.node_rank): f"{e.name} (node rank {r.node_rank} of {len(e.nodes)})"
                for r in e.node_ranks
            }
    return labels


# What trainer=megatron builds for each lora_mode, and how it lays the samples of a micro-batch out.
MEGATRON_LORA = {
    "raw": "megatron-core, raw LoRA on megatron linears",
    "bridge": "megatron-core + Megatron-Bridge PEFT LoRA",
}
# Multi-LoRA: Megatron-Bridge 0.6.2 has no MultiLoRA, so the slots are raw LoRA slots on either model.
MEGATRON_SLOTS = {
    "raw": "megatron-core, raw LoRA slots (one per adapter) on megatron linears",
    "bridge": "Megatron-Bridge's model, raw LoRA slots (one per adapter) on its linears",
}
QKV_FORMATS = {"thd": "thd packs samples", "bshd": "bshd pads rows"}


def trainer_line(plan: Plan) -> str:
    t, p = plan.trainer, plan.trainer.parallel
    ranks = f"{p.world_size} rank{'s' if p.world_size != 1 else ''}"
    line = f"{t.backend}, {ranks}, TP {p.tp}, EP {p.ep}, PP {p.pp}, CP {p.cp}, DP {p.dp}"
    if t.backend == "megatron":
        line += f", {megatron_line(plan)}"
    if plan.adapters and not plan.multi_lora:
        a = plan.adapters[0]
        line += f", LoRA r{a.rank} a{a.alpha:g} via {t.lora_mode} on [{', '.join(a.target_modules)}]"
    elif plan.multi_lora:
        line += f", multi-LoRA via {t.lora_mode}"
    line += f", {train_offload_text(plan)}" if t.offload_train else ""
    return line + (f", hosted by {t.host.argv[0]} (a process of its own)" if t.host else "")


def train_offload_text(plan: Plan) -> str:
    """Where the trainer's state goes between trains, and whether that frees anything on this cluster."""
    t = plan.trainer
    if t.offload_target == "disk":
        where = t.offload_disk_dir or "miles_train_offload_<uid> under $SCRATCH, else the temporary folder"
        return f"offload to disk ({t.offload_disk_chunk_mb} MB chunks in {where})"
    if plan.cluster.cpu_only:
        return "offload to cpu (on a CPU host this moves nothing: the state is in host memory already)"
    return "offload to cpu"


def megatron_line(plan: Plan) -> str:
    """What the Megatron trainer runs: its LoRA path, its qkv format, and sequence parallelism, which it turns on
    whenever TP > 1 (trainer/megatron/parallel.Layout.from_plan)."""
    t, p = plan.trainer, plan.trainer.parallel
    paths = MEGATRON_SLOTS if plan.multi_lora else MEGATRON_LORA
    parts = [paths.get(t.lora_mode, "megatron-core"), QKV_FORMATS[p.qkv_format]]
    return ", ".join(parts + (["SP"] if p.tp > 1 else []))


def algorithm_line(plan: Plan) -> str:
    """The estimator, where its KL goes, the optimizer and the loss and micro-batch switches the trainer acts on."""
    a, t = plan.algorithm, plan.trainer
    reinforce = a.advantage_estimator.startswith("reinforce_plus_plus")
    parts = [a.advantage_estimator]
    if a.kl_coef:
        parts.append(f"KL {a.kl_coef:g} in the {'reward' if reinforce else 'loss'}")
    if a.advantage_estimator == "reinforce_plus_plus":
        parts.append(f"gamma {a.gamma:g}")
    parts.append(f"{plan.optimizer.name} lr {plan.optimizer.lr:g}")
    if plan.optimizer.cpu_offload:  # Megatron's HybridDeviceOptimizer offloads GPU parameters only
        on_cpu = " (on a CPU host it is there already: nothing moves)" if plan.cluster.cpu_only else ""
        parts.append(f"optimizer state and step on the host (Megatron's HybridDeviceOptimizer){on_cpu}")
    parts.append("per-token loss" if t.calculate_per_token_loss else "per-sample loss")
    budget = t.max_tokens_per_micro_batch
    parts.append(f"micro-batches <= {budget} tokens" if budget else f"micro-batches of {t.parallel.micro_batch_size}")
    if t.parallel.recompute:
        parts.append("activation recompute")
    return ", ".join(parts)


def engines_line(plan: Plan) -> str:
    e = plan.engines[0]
    kind = "SGLang" if e.kind == "sglang" else "embedded (CPU)"
    build = f"stock {SGLANG_VERSION}" if e.build == STOCK else "sglang-miles fork"
    flags = e.launch.argv
    line = f"{len(plan.engines)} x {kind} ({build} protocol), TP {e.tp_size} each"
    line += ", routed experts on" if "--enable-return-routed-experts" in flags else ""
    if "--max-lora-rank" in flags:
        line += f", max LoRA rank {flags[flags.index('--max-lora-rank') + 1]}"
    if "--max-n" in flags:  # the embedded engine's request limits; SGLang has none (plan/rules/engine_limits.py)
        n, outputs = flags[flags.index("--max-n") + 1], flags[flags.index("--max-batch-size") + 1]
        line += f", requests of at most n {n} and {outputs} outputs"
    else:
        line += ", no per-request n or batch limit (SGLang has none)"
    return line


def session_line(plan: Plan) -> str:
    s = plan.session
    assert s is not None
    adapter = f"adapter {s.lora_name} on every turn" if s.lora_name else "adapter per session slot"
    if not plan.capabilities.lora_rollout_enabled:
        adapter = "base model (no LoRA rollout)"
    r3 = "on" if s.use_addition_r3 else "off"
    pause = plan.weight_sync.pause_generation_mode
    return (
        f"{s.version} on :{s.launch.port_label}, {turns_line(plan)}, {adapter}, incremental R3 {r3} "
        f"(pause mode {pause}), TITO {s.tito_model}, matcher {s.message_matcher}"
    )


def rollout_line(plan: Plan) -> str:
    """How rollouts reach the engines (sglang_client/engine_pool.py): straight to an engine, never through the router
    (it drops the R3 request fields)."""
    if plan.session:
        return f"agentic episodes through the session server on :{plan.session.launch.port_label}"
    return f"single-turn, {pinned(plan, 'prompt group')}, samples as /generate"


def turns_line(plan: Plan) -> str:
    """Where the session server sends turns (session/upstream.py): never through the router, which drops R3."""
    return f"{pinned(plan, 'session')}, turns as /generate"


def pinned(plan: Plan, what: str) -> str:
    """Where each group or session goes (least-loaded, sglang_client/engine_pool.py): every engine the plan starts
    serves."""
    n = len(plan.engines)
    if plan.router:
        return f"each {what} pinned to 1 of the router's {n} worker{'s' * (n != 1)} (least-loaded)"
    return f"each {what} pinned to 1 of {n} engines (least-loaded)" if n > 1 else f"each {what} to the one engine"


def sync_line(plan: Plan) -> str:
    s, r = plan.weight_sync, plan.rollout
    flush = "flush" if s.flush_cache else "no flush"
    return (
        f"{s.transfer_mode}, pause {s.pause_generation_mode}, {flush}, every {s.update_weights_interval} step(s), "
        f"max staleness {r.max_weight_staleness}, schedule {r.schedule}" + (", fully async" if r.fully_async else "")
    )


def offload_line(plan: Plan) -> str:
    """What the engines give back after each rollout, and what that frees on this cluster (the embedded engine:
    memory_occupation.py)."""
    tags = plan.weight_sync.offload_tags
    backup = bool(plan.engines) and "--enable-weights-cpu-backup" in plan.engines[0].launch.argv
    restore = "from their CPU backup" if backup else "by reloading the model path"
    line = f"engines release {', '.join(tags)} after each rollout; weights back before the push ({restore})"
    line += ", the rest after"
    if not plan.cluster.cpu_only:
        return line
    frees = ["no CUDA graphs on CPU"]
    if "weights" in tags and backup:
        frees.append("the weights' CPU backup is their own host memory, so only the KV cache is freed")
    return f"{line} ({'; '.join(frees)})"


def verify_line(plan: Plan) -> str:
    s = plan.weight_sync
    gap = (
        f"every engine's logprob gap <= {s.max_logprob_gap:g} on a fixed probe right after each push, before "
        "training further"
        if s.verify
        else "logprob gap off (weight_sync.verify)"
    )
    return f"every engine reports each pushed weight version; {gap}"


def batch_line(plan: Plan) -> str:
    b = plan.batch
    return (
        f"{b.rollout_batch_size} prompts x {b.n_samples_per_prompt} samples = {b.samples_per_rollout} samples/step, "
        f"global batch {b.global_batch_size}, {b.num_steps} steps"
    )


def derived_line(plan: Plan) -> str:
    c = plan.capabilities
    on = [
        name
        for name, value in (
            ("offload train", c.offload_train),
            ("offload rollout", c.offload_rollout),
            ("routing replay", c.use_routing_replay),
            ("addition R3", c.use_addition_r3),
            ("std-normalised advantages", c.normalize_advantages_by_std),
            ("dynamic global batch", c.use_dynamic_global_batch_size),
        )
        if value
    ]
    return ", ".join(on) or "nothing"


def command_lines(plan: Plan) -> list[str]:
    named: list[tuple[str, Launch]] = []
    for e in plan.engines:
        named.append((f"engine {e.index}" + (" rank 0" if e.node_ranks else ""), e.launch))
        named += [(f"engine {e.index} rank {r.node_rank}", r.launch) for r in e.node_ranks]
    if plan.router:
        named.append(("router", plan.router.launch))
    if plan.session:
        named.append(("session", plan.session.launch))
    if plan.multi_lora:
        named.append(("controller", plan.multi_lora.launch))
    named.append(("driver", plan.trainer.launch))  # trainer rank 0 (else the host is); it starts the other ranks
    if plan.trainer.host:
        named.append(("trainer", plan.trainer.host))
    width = max(len(n) for n, _ in named)
    return [f"   {name:<{width}}  {render_command(launch)}" for name, launch in named]


def render_command(launch: Launch) -> str:
    env = " ".join(f"{k}={v}" for k, v in launch.env.items())
    return (env + " " if env else "") + shlex.join(launch.argv)
