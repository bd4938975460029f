"""compile_plan: a validated MilesConfig -> Plan, or one PlanError listing every violated rule.

Imports nothing heavy (no torch, ray, transformers or sglang): compiling and printing a plan must stay fast.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from miles_runner.config.compose import ComposedConfig
from miles_runner.config.provenance import format_value
from miles_runner.config.schema import AUTO_PORT, MilesConfig, OptimizerConfig, Port, lookup
from miles_runner.core.adapters import AdapterSpec, adapter_spec
from miles_runner.core.errors import PlanError, Problem
from miles_runner.core.sglang_protocol import offload_tags
from miles_runner.plan import render
from miles_runner.plan.derive import (
    Derived,
    absolute_path,
    adapter_value,
    adapter_values,
    derive,
    resolve_data_path,
)
from miles_runner.plan.devices import engine_dist_init_port, engine_layouts, engine_rank_port, trainer_devices
from miles_runner.plan.model import (
    CONTROLLER,
    ROUTER_METRICS,
    BatchPlan,
    Capabilities,
    ClusterPlan,
    EnginePlan,
    EngineRank,
    Launch,
    MultiLoRAPlan,
    Parallelism,
    Plan,
    RouterPlan,
    SessionPlan,
    TrainerPlan,
    WeightSyncPlan,
    engine_rank_name,
    node_host,
    resolve_max_logprob_gap,
    resolve_verify,
)
from miles_runner.plan.rules import NOT_BUILT, PRECONDITIONS, RULES, Finding, RuleFn

LOOPBACK = "127.0.0.1"
# Where the router and the session server run on a plan that spans nodes: beside the driver (trainer rank 0).
SERVICES_NODE = 0
# What the rules being checked are given: Derived, or None for the preconditions.
D = TypeVar("D", bound=Derived | None)


def compile_plan(composed: ComposedConfig) -> Plan:
    """The plan this release runs: every rule, including the refusals of what it has not built."""
    return _compile(composed, RULES)


def compile_design(composed: ComposedConfig) -> Plan:
    """The plan a release with everything built would run: every rule except the NOT_BUILT refusals. For
    reviewing GPU recipes (golden plans, rule tables); never executed: runs always go through compile_plan."""
    return _compile(composed, {rule_id: check for rule_id, check in RULES.items() if rule_id not in NOT_BUILT})


def plan_or_design(composed: ComposedConfig) -> tuple[Plan, PlanError | None]:
    """The plan; or, when this release refuses it only for what it has not built, its design and the refusal (to
    show what it would run, never to run it). Any other problem raises."""
    try:
        return compile_plan(composed), None
    except PlanError as exc:
        if not all(problem.rule in NOT_BUILT for problem in exc.problems):
            raise
        return compile_design(composed), exc


def _compile(composed: ComposedConfig, rules: Mapping[str, RuleFn]) -> Plan:
    cfg = composed.config
    check_rules(PRECONDITIONS, composed, None)
    d = derive(cfg)
    check_rules(rules, composed, d)
    return build_plan(cfg, d, composed.recipe)


def check_rules(
    rules: Mapping[str, Callable[[MilesConfig, D], Iterator[Finding]]], composed: ComposedConfig, d: D
) -> None:
    problems = [
        to_problem(rule_id, finding, composed)
        for rule_id, check in rules.items()
        for finding in check(composed.config, d)
    ]
    if problems:
        raise PlanError(problems)


ITEM_KEY = re.compile(r"^adapters\.runs\[(\d+)\]\.(\w+)$")


def to_problem(rule_id: str, finding: Finding, composed: ComposedConfig) -> Problem:
    settings: list[tuple[str, str]] = []
    for key in finding.keys:
        shown, origin = display_setting(key, composed)
        if (shown, str(origin)) not in settings:
            settings.append((shown, str(origin)))
    return Problem(rule_id, settings, finding.reason, finding.fix)


def display_setting(key: str, composed: ComposedConfig) -> tuple[str, Any]:
    """A list item (adapters.runs[i].field) shows its effective value and the origin of that item's field."""
    cfg, provenance = composed.config, composed.provenance
    if match := ITEM_KEY.match(key):
        index, field = int(match.group(1)), match.group(2)
        value = adapter_value(cfg.adapters.runs[index], field, cfg)
        return f"{key}={format_value(value)}", provenance.origin(f"adapters.runs.{index}.{field}")
    return provenance.display(key, lookup(cfg, key))


def build_plan(cfg: MilesConfig, d: Derived, recipe: str | None) -> Plan:
    engines = build_engines(cfg, d)
    router = build_router(cfg, d, engines)
    adapters = build_adapters(cfg, d)
    return Plan(
        name=cfg.run.name,
        recipe=recipe,
        seed=cfg.run.seed,
        topology=cfg.topology.kind,
        model=cfg.model,
        model_path=d.model_path,
        cluster=ClusterPlan(
            cfg.cluster.nodes,
            cfg.cluster.gpus_per_node,
            cfg.cluster.gpu_type,
            cfg.cluster.cpu_only,
            d.devices_per_node,
            d.total_devices,
        ),
        trainer=build_trainer(cfg, d),
        engines=engines,
        router=router,
        session=build_session(cfg, d, router, engines),
        multi_lora=build_multi_lora(cfg, d),
        adapters=adapters,
        batch=build_batch(cfg, d),
        weight_sync=WeightSyncPlan(
            transfer_mode=d.transfer_mode,
            pause_generation_mode=cfg.weight_sync.pause_generation_mode,
            flush_cache=d.flush_on_sync,
            update_weights_interval=cfg.weight_sync.update_weights_interval,
            verify=resolve_verify(cfg.weight_sync.verify),
            max_logprob_gap=resolve_max_logprob_gap(cfg.weight_sync.max_logprob_gap, cfg.engine.kind),
            offload_tags=offload_tags(cfg.topology.offload_rollout_level) if d.offload_rollout else [],
        ),
        capabilities=Capabilities(
            lora_enabled=d.lora_enabled,
            lora_rollout_enabled=d.lora_rollout_enabled,
            multi_lora=d.multi_lora,
            use_routing_replay=cfg.rollout.routing_replay,
            use_addition_r3=d.use_addition_r3,
            offload_train=d.offload_train,
            offload_rollout=d.offload_rollout,
            normalize_advantages_by_std=d.normalize_std,
            use_dynamic_global_batch_size=d.multi_lora,
        ),
        rollout=dataclasses.replace(cfg.rollout, data=resolve_data_path(cfg.rollout.data)),
        algorithm=cfg.algorithm,
        optimizer=build_optimizer(cfg, d),
        checkpoint=cfg.checkpoint,
        executor=cfg.executor,
        logger=cfg.logger,
        security=cfg.security,
    )


def build_optimizer(cfg: MilesConfig, d: Derived) -> OptimizerConfig:
    """Multi-LoRA keeps each slot's optimizer whole on every rank: miles forces use_distributed_optimizer off."""
    return dataclasses.replace(cfg.optimizer, use_distributed_optimizer=False) if d.multi_lora else cfg.optimizer


def build_trainer(cfg: MilesConfig, d: Derived) -> TrainerPlan:
    p = cfg.trainer.parallel
    return TrainerPlan(
        backend=cfg.trainer.backend,
        lora_mode=cfg.trainer.lora_mode,
        parallel=Parallelism(
            p.tp,
            p.pp,
            p.cp,
            p.ep,
            p.etp,
            d.dp_size,
            d.trainer_world_size,
            p.micro_batch_size,
            p.qkv_format,
            p.recompute,
        ),
        placements=[list(s) for s in trainer_devices(d)],
        offload_train=d.offload_train,
        offload_target=cfg.trainer.offload_target,
        offload_disk_dir=cfg.trainer.offload_disk_dir,
        offload_disk_chunk_mb=cfg.trainer.offload_disk_chunk_mb,
        launch=Launch(render.trainer_argv(cfg, d), port=0, health_path=""),
        calculate_per_token_loss=cfg.trainer.calculate_per_token_loss,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_gpu if cfg.trainer.use_dynamic_batch_size else 0,
        host=_trainer_host(cfg.trainer.python),
    )


def _trainer_host(python: str) -> Launch | None:
    return Launch(render.trainer_host_argv(python), port=0, health_path="") if python else None


def host_on(cfg: MilesConfig, node: int) -> str:
    """The address a component on plan node `node` binds: loopback on one node; across nodes that node's own
    address (its placeholder, filled in by the node agent at run time), never 0.0.0.0."""
    return LOOPBACK if cfg.cluster.nodes == 1 else node_host(node)


def build_engines(cfg: MilesConfig, d: Derived) -> list[EnginePlan]:
    """One engine per tp_size rollout devices: one launch within a node; wider, one launch per node it spans."""
    engines = []
    for i, layout in enumerate(engine_layouts(cfg, d)):
        nodes = list(layout)
        launches = [engine_launch(cfg, d, i, nodes, layout[node], rank) for rank, node in enumerate(nodes)]
        ranks = [EngineRank(r, nodes[r], layout[nodes[r]], launches[r]) for r in range(1, len(nodes))]
        engines.append(
            EnginePlan(
                i,
                cfg.engine.kind,
                cfg.engine.build,
                nodes,
                layout[nodes[0]],
                cfg.engine.tp_size,
                cfg.engine.ep_size,
                launches[0],
                cfg.engine.startup_timeout_s,
                ranks,
            )
        )
    return engines


def engine_launch(
    cfg: MilesConfig, d: Derived, index: int, nodes: list[int], device_ids: list[int], rank: int
) -> Launch:
    """Node rank `rank` of engine `index`, on nodes[rank], serving on its engine_rank_port (plan/devices.py). Across
    nodes every rank runs SGLang's same command with its --node-rank, all meeting at rank 0's node on the engine's
    dist-init port; a rank R > 0 serves its stand-in /health on its own node."""
    node, name = nodes[rank], engine_rank_name(index, rank) if rank else f"engine{index}"
    base = cfg.engine.base_port
    port = server_port(base, name) if base == AUTO_PORT else Launch([], port=engine_rank_port(cfg, d, index, rank))
    env = {} if cfg.cluster.cpu_only else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, device_ids))}
    node_rank = None
    if len(nodes) > 1:
        dist_init = f"{host_on(cfg, nodes[0])}:{engine_dist_init_port(cfg, index)}"
        node_rank = render.NodeRank(len(nodes), rank, dist_init)
    argv = render.engine_argv(cfg, d, host=host_on(cfg, node), port=port.port_text, node_rank=node_rank)
    return Launch(argv, host_on(cfg, node), port.port, env, "/health", port.port_name)


def server_port(setting: Port, name: str) -> Launch:
    """A server's port setting as a Launch's port fields (the rest is filled in by the caller): the fixed number,
    or, for "auto", port 0 and the name its port is chosen under at start."""
    return Launch([], port=0, port_name=name) if setting == AUTO_PORT else Launch([], port=int(setting))


def build_router(cfg: MilesConfig, d: Derived, engines: list[EnginePlan]) -> RouterPlan | None:
    if cfg.router.kind == "none":
        return None
    urls, host = [e.launch.url for e in engines], host_on(cfg, SERVICES_NODE)
    port, metrics = server_port(cfg.router.port, "router"), server_port(cfg.router.metrics_port, ROUTER_METRICS)
    argv = render.router_argv(
        host,
        port.port_text,
        d.router_policy,
        urls,
        metrics_port=metrics.port_text,
        api_key_env=cfg.security.api_key_env,
    )
    return RouterPlan(d.router_policy, Launch(argv, host, port.port, {}, "/health", port.port_name))


def build_session(
    cfg: MilesConfig, d: Derived, router: RouterPlan | None, engines: list[EnginePlan]
) -> SessionPlan | None:
    if cfg.session.version == "off":
        return None
    # Multi-LoRA sessions name their adapter slot per session; a single adapter is on every turn.
    lora_name = d.engine_lora_names[0] if d.lora_rollout_enabled and not d.multi_lora else None
    router_url, engine_urls = (router.launch.url if router else None), [e.launch.url for e in engines]
    # session.host is the single-node bind address; across nodes the server binds node 0's own address (the
    # rule multi-node-session-host refuses another session.host there).
    host = cfg.session.host if cfg.cluster.nodes == 1 else host_on(cfg, SERVICES_NODE)
    port = server_port(cfg.session.port, "session")
    argv = render.session_argv(
        cfg, d, host=host, port=port.port_text, router_url=router_url, engine_urls=engine_urls, lora_name=lora_name
    )
    return SessionPlan(
        version=cfg.session.version,
        lora_name=lora_name,
        use_addition_r3=d.use_addition_r3,
        return_routed_experts=cfg.rollout.routing_replay,
        tito_model=cfg.session.tito_model,
        message_matcher=cfg.session.message_matcher,
        launch=Launch(argv, host, port.port, {}, "/health", port.port_name),
    )


def build_multi_lora(cfg: MilesConfig, d: Derived) -> MultiLoRAPlan | None:
    if not d.multi_lora:
        return None
    a = cfg.adapters
    port = server_port(a.api_port, CONTROLLER)
    argv = render.controller_argv(LOOPBACK, port.port_text, cfg.security.api_key_env)
    return MultiLoRAPlan(
        slots=d.multi_lora_slots,
        max_lora_rank=d.max_lora_rank,
        target_modules=d.target_modules,
        default_rank=a.rank,
        default_alpha=a.alpha,
        max_adapter_global_batch_size=d.max_adapter_global_batch_size,
        max_coalesce_wait_s=a.max_coalesce_wait_s,
        max_empty_wait_s=a.max_empty_wait_s,
        idle_poll_s=a.idle_poll_s,
        service_mode=a.service_mode,
        launch=Launch(argv, LOOPBACK, port.port, {}, "/health", port.port_name),
    )


def build_adapters(cfg: MilesConfig, d: Derived) -> list[AdapterSpec]:
    a, r = cfg.adapters, cfg.rollout
    if a.kind == "single":
        values = {
            "rank": a.rank,
            "alpha": a.alpha,
            "target_modules": d.target_modules,
            "task": r.task,
            "reward": r.reward,
            "lr": cfg.optimizer.lr,
            "rollout_batch_size": r.rollout_batch_size,
            "n_samples_per_prompt": r.n_samples_per_prompt,
            "data": resolve_data_path(r.data),
            "init_path": absolute_path(a.path),
        }
        return [adapter_spec(d.engine_lora_names[0], d.engine_lora_names[0], values, dropout=a.dropout)]
    if a.kind != "multi":
        return []
    return [
        adapter_spec(
            run.name,
            d.engine_lora_names[slot] if slot < len(d.engine_lora_names) else "",
            {**adapter_values(cfg, run), "data": resolve_data_path(run.data)},
            dropout=a.dropout,
        )
        for slot, run in enumerate(a.runs)
    ]


def build_batch(cfg: MilesConfig, d: Derived) -> BatchPlan:
    r = cfg.rollout
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    return BatchPlan(
        rollout_batch_size=r.rollout_batch_size,
        n_samples_per_prompt=r.n_samples_per_prompt,
        samples_per_rollout=samples,
        global_batch_size=d.global_batch_size,
        steps_per_rollout=max(samples // d.global_batch_size, 1),
        num_steps=cfg.algorithm.num_steps,
        max_response_len=r.max_response_len,
        max_turns=r.max_turns,
    )
