"""The cluster's arithmetic: parallel groups that divide the GPUs and experts, engines that fit their GPUs and
memory, one node for the local executor, batches that split evenly, ports that do not collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from miles_runner.config.schema import AUTO_PORT, MilesConfig, lookup
from miles_runner.plan.derive import Derived
from miles_runner.plan.devices import (
    DIST_INIT_EXTRA_PORTS,
    Device,
    EngineLayout,
    engine_dist_init_port,
    engine_layouts,
    engine_rank_port,
    rollout_devices,
    split_into_engines,
)
from miles_runner.plan.rules.base import TOPOLOGY, Finding, rule


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
            f"engine.tp_size={largest_divisor(d.rollout_gpus, min(tp, d.devices_per_node))}"
            if d.rollout_gpus
            else "topology.rollout_num_gpus=1",
        )


@rule("engine-split-evenly-over-nodes")
def engine_split_evenly_over_nodes(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    """SGLang runs an engine over N nodes (--nnodes N) as tp_size / N ranks on each node, on that node's first
    tp_size / N visible GPUs: an engine with more devices on one node than another would fail its tp_size % nnodes
    check or leave a GPU it was given idle while another node's rank lacks one."""
    tp, devices = cfg.engine.tp_size, rollout_devices(cfg, d)
    for index, layout in enumerate(engine_layouts(cfg, d)):
        if sum(map(len, layout.values())) == tp and not split_evenly(layout):  # a short engine: cluster-holds-plan
            placement = () if d.colocated else ("topology.rollout_num_gpus",)  # colocated: the trainer's devices
            yield Finding(
                ("engine.tp_size", TOPOLOGY, "topology.actor_num_gpus_per_node", *placement),
                f"engine{index} (TP {tp}) would run on {describe_layout(layout)}, but SGLang places an engine's "
                f"ranks evenly over its nodes (--nnodes {len(layout)}: {ranks_per_node(tp, len(layout))}), so each "
                f"node of an engine must hold as many of its devices. {whole_node_hint(cfg, d)}".rstrip(),
                f"engine.tp_size={even_tp_size(devices, tp)}",
            )
            return  # one finding: the fix re-lays every engine


def split_evenly(layout: EngineLayout) -> bool:
    return len({len(ids) for ids in layout.values()}) <= 1


def ranks_per_node(tp: int, nodes: int) -> str:
    return f"{tp // nodes} per node, on each node's first visible GPUs" if tp % nodes == 0 else f"TP {tp} won't divide"


def describe_layout(layout: EngineLayout) -> str:
    return " + ".join(f"{len(ids)} devices of node {node} ({','.join(map(str, ids))})" for node, ids in layout.items())


def even_tp_size(devices: list[Device], tp: int) -> int:
    """The largest engine size below tp that makes whole engines of these devices, each split evenly (1 always)."""
    return next(
        t
        for t in range(tp - 1, 0, -1)
        if len(devices) % t == 0 and all(map(split_evenly, split_into_engines(devices, t, len(devices) // t)))
    )


def whole_node_hint(cfg: MilesConfig, d: Derived) -> str:
    """The other way out: engines that start on a node boundary, because the trainer takes whole nodes."""
    if d.colocated or d.trainer_gpus_per_node % d.devices_per_node == 0:
        return ""
    return (
        f"A trainer on whole nodes (topology.actor_num_gpus_per_node={d.devices_per_node}) would also start the "
        "engines on a node boundary."
    )


@rule("cluster-holds-plan")
def cluster_holds_plan(cfg: MilesConfig, d: Derived) -> Iterator[Finding]:
    if d.colocated:
        return
    left = d.total_devices - d.trainer_world_size
    shrink_trainer = f"topology.actor_num_gpus_per_node={max(d.trainer_gpus_per_node // 2, 1)}"
    if d.trainer_world_size + d.rollout_gpus > d.total_devices:
        yield Finding(
            ("topology.actor_num_gpus_per_node", "topology.rollout_num_gpus", "cluster.nodes"),
            f"Trainer ({d.trainer_world_size}) + rollout ({d.rollout_gpus}) GPUs exceed the cluster's "
            f"{d.total_devices}.",
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
    """Every fixed port the plan binds, counted as compile_plan numbers them: each node rank of each engine, the
    rendezvous ports of the engines that span nodes, and the named services. Ports chosen at start ("auto") are
    free when chosen, and distinct (procs/ports.py never hands out one twice)."""
    layouts = engine_layouts(cfg, d)
    rank_ports = []
    if cfg.engine.base_port != AUTO_PORT:
        rank_ports = [engine_rank_port(cfg, d, i, r) for i, layout in enumerate(layouts) for r in range(len(layout))]
    spanning = [i for i, layout in enumerate(layouts) if len(layout) > 1]
    dist_init = [engine_dist_init_port(cfg, i) + k for i in spanning for k in range(DIST_INIT_EXTRA_PORTS + 1)]
    services = {
        "router.port": cfg.router.port if cfg.router.kind != "none" else None,
        "router.metrics_port": cfg.router.metrics_port if cfg.router.kind != "none" else None,
        "session.port": cfg.session.port if cfg.session.version != "off" else None,
        "adapters.api_port": cfg.adapters.api_port if d.multi_lora else None,
    }
    claims = [("engine.base_port", rank_ports)]
    claims += [(key, [port]) for key, port in services.items() if isinstance(port, int)]
    claims.append(("engine.dist_init_port", dist_init))  # where node ranks meet (and SGLang's next 6 ports)
    engines = f"engine node ranks use {min(rank_ports)}..{max(rank_ports)}" if rank_ports else "no engine ports"
    seen: dict[int, str] = {}
    for key, ports in claims:
        clashes = dict.fromkeys(seen[p] for p in ports if p in seen)
        for other in clashes:
            port = next(p for p in ports if seen.get(p) == other)
            yield Finding((key, other), f"Port {port} is used twice ({engines}).", f"{key}={lookup(cfg, key) + 100}")
        seen.update({p: key for p in ports if p not in seen})
