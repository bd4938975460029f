"""The Plan: a frozen, serialisable description of exactly what a run starts and how.

Components receive their slice of it (an EnginePlan, the SessionPlan, ...), never the raw Hydra config.
`plan.yaml` is `plan_to_dict(plan)` dumped as YAML, and `plan_from_dict` reads it back through the same
schema loader as the config, so a run executes exactly the plan that was saved.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles_runner.config.loader import load_dataclass
from miles_runner.config.schema import (
    AUTO_PORT,
    AlgorithmConfig,
    CheckpointConfig,
    EngineConfig,
    ExecutorConfig,
    LoggerConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    SecurityConfig,
)
from miles_runner.core.adapters import AdapterSpec
from miles_runner.plan.devices import DIST_INIT_EXTRA_PORTS

# A plan that spans nodes names each node's address by a placeholder, `{node<K>}` (plan node K: the Ray node that
# offers core.cluster_nodes.node_resource(K)); the node agents fill in the nodes' own addresses at run time.
# A single-node plan has no placeholder: its components bind loopback.
NODE_HOST = re.compile(r"\{node(\d+)\}")


def node_host(node: int) -> str:
    """The placeholder for plan node `node`'s own address."""
    return f"{{node{node}}}"


def fill_node_hosts(text: str, addresses: Sequence[str]) -> str:
    """`text` with every `{node<K>}` replaced by addresses[K]."""
    return NODE_HOST.sub(lambda m: addresses[int(m.group(1))], text)


# A port chosen at start (config "auto") is a placeholder too, `{port:<name>}`: in its server's URL and in every
# command line that names that server (the router's engines, the session server's upstreams). The executor that
# starts the server picks a free port on its node and fills it in everywhere (plan_with_ports).
PORT_PLACEHOLDER = re.compile(r"\{port:([\w-]+)\}")
ROUTER_METRICS = "router-metrics"  # the router's second port, in its command line only
PORTS_FILE = "ports.json"  # in the run folder: every port chosen at start, by name, as the servers bound them


def port_placeholder(name: str) -> str:
    """The placeholder for the port of `name` (a component, or ROUTER_METRICS), chosen at start."""
    return f"{{port:{name}}}"


def fill_ports(text: str, ports: Mapping[str, int]) -> str:
    """`text` with the placeholder of every port in `ports` replaced by its number; others stay."""
    return PORT_PLACEHOLDER.sub(lambda m: str(ports[m.group(1)]) if m.group(1) in ports else m.group(0), text)


@dataclass(frozen=True)
class Launch:
    """How to start one real component: argv (argv[0] "python" means the run's interpreter), env, address.

    `host` is loopback on a single-node plan; on a plan that spans nodes it is the placeholder of the node the
    component runs on (`{node1}`), which also tells the executor where to start it (`node`)."""

    argv: list[str]
    host: str = "127.0.0.1"
    port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    health_path: str = "/health"
    port_name: str = ""  # its port is chosen at start as `{port:<port_name>}` (port 0 until then); "": fixed

    @property
    def port_text(self) -> str:
        """The port, or its placeholder while it is still to be chosen."""
        return port_placeholder(self.port_name) if self.port_name else str(self.port)

    @property
    def port_label(self) -> str:
        """The port as a reader sees it: the number, or "auto" while it is still to be chosen."""
        return AUTO_PORT if self.port_name else str(self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port_text}"

    def placeholders(self) -> set[str]:
        """The names of the ports still to be chosen that this launch binds or names."""
        texts = [self.host, *self.argv, *self.env.values()]
        return {self.port_name} - {""} | {name for text in texts for name in PORT_PLACEHOLDER.findall(text)}

    @property
    def node(self) -> int:
        """The plan node this component runs on: its host's placeholder, else node 0 (a single-node plan)."""
        match = NODE_HOST.fullmatch(self.host)
        return int(match.group(1)) if match else 0

    def on_nodes(self, addresses: Sequence[str]) -> Launch:
        """This launch with the nodes' own addresses in place of their placeholders (host, argv and env)."""
        return self.filled(lambda text: fill_node_hosts(text, addresses))

    def with_ports(self, ports: Mapping[str, int]) -> Launch:
        """This launch with the ports of `ports` in place of their placeholders, its own port among them."""
        filled = self.filled(lambda text: fill_ports(text, ports))
        if self.port_name in ports:
            return dataclasses.replace(filled, port=ports[self.port_name], port_name="")
        return filled

    def filled(self, fill: Callable[[str], str]) -> Launch:
        """This launch with `fill` applied to its host, argv and env values."""
        return dataclasses.replace(
            self,
            host=fill(self.host),
            argv=[fill(a) for a in self.argv],
            env={k: fill(v) for k, v in self.env.items()},
        )


@dataclass(frozen=True)
class ClusterPlan:
    nodes: int
    gpus_per_node: int
    gpu_type: str
    cpu_only: bool
    devices_per_node: int  # GPUs, or CPU worker processes on a cpu-only cluster
    total_devices: int


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    micro_batch_size: int
    qkv_format: str
    recompute: bool = False  # activation recomputation (gradient checkpointing of every decoder layer)


@dataclass(frozen=True)
class TrainerPlan:
    backend: str
    lora_mode: str
    parallel: Parallelism
    placements: list[list[int]]  # [node, device] per rank
    offload_train: bool
    offload_target: str
    launch: Launch
    offload_disk_dir: str = ""  # offload_target=disk: where the chunks go ("": trainer/train_offload.py's default)
    offload_disk_chunk_mb: int = 64
    calculate_per_token_loss: bool = False  # the loss is the mean over the step's tokens, not over its samples
    # Micro-batches hold at most this many tokens (first fit), instead of micro_batch_size samples; 0: off.
    max_tokens_per_micro_batch: int = 0
    # trainer.python set: the trainer host's command (rank 0 in that interpreter, trainer/host.py); None: rank 0 is
    # the driver itself.
    host: Launch | None = None


@dataclass(frozen=True)
class EngineRank:
    """Node rank > 0 of an engine wider than a node: the same SGLang command with `--node-rank R`, on its own
    node, joining rank 0 at `--dist-init-addr`. It serves no API: SGLang gives it only a stand-in /health on its
    own host and port once its schedulers are up (utils.common.launch_dummy_health_check_server)."""

    node_rank: int
    node: int
    device_ids: list[int]  # GPU ids on its node (CUDA_VISIBLE_DEVICES)
    launch: Launch


@dataclass(frozen=True)
class EnginePlan:
    index: int
    kind: str
    build: str  # stock (the pinned SGLang release) | miles_fork (core.sglang_protocol)
    nodes: list[int]
    device_ids: list[int]  # GPU ids on the first node (CUDA_VISIBLE_DEVICES)
    tp_size: int
    ep_size: int
    launch: Launch  # node rank 0: the HTTP server the router, the session server and the driver talk to
    startup_timeout_s: float = EngineConfig.startup_timeout_s  # how long it may take to become healthy
    node_ranks: list[EngineRank] = field(default_factory=list)  # ranks 1.. on nodes[1:]; none within one node

    @property
    def name(self) -> str:
        return f"engine{self.index}"

    def mapped(self, change: Callable[[Launch], Launch]) -> EnginePlan:
        """This engine with `change` applied to the launch of every node rank."""
        ranks = [dataclasses.replace(r, launch=change(r.launch)) for r in self.node_ranks]
        return dataclasses.replace(self, launch=change(self.launch), node_ranks=ranks)

    def placements(self) -> list[tuple[int, int]]:
        """Every (node, device) the engine runs on, all its node ranks."""
        return [(self.nodes[0], s) for s in self.device_ids] + [
            (r.node, s) for r in self.node_ranks for s in r.device_ids
        ]


CONTROLLER = "multi_lora_controller"  # the multi-LoRA controller service's component name (its log, its port)


def engine_rank_name(index: int, node_rank: int) -> str:
    """The component name of node rank > 0 of engine `index` (its log is logs/<name>.log)."""
    return f"engine{index}-node-rank{node_rank}"


@dataclass(frozen=True)
class RouterPlan:
    policy: str
    launch: Launch


@dataclass(frozen=True)
class SessionPlan:
    version: str
    lora_name: str | None  # the adapter every turn is generated with; None without LoRA rollouts
    use_addition_r3: bool
    return_routed_experts: bool
    tito_model: str
    launch: Launch
    message_matcher: str = "strict"


@dataclass(frozen=True)
class MultiLoRAPlan:
    slots: int
    max_lora_rank: int  # what the engines serve: every adapter fits within it
    target_modules: list[str]
    default_rank: int  # for adapters registered at run time without their own
    default_alpha: float
    max_adapter_global_batch_size: int
    max_coalesce_wait_s: float
    max_empty_wait_s: float
    idle_poll_s: float
    service_mode: bool
    launch: Launch


@dataclass(frozen=True)
class BatchPlan:
    rollout_batch_size: int
    n_samples_per_prompt: int
    samples_per_rollout: int
    global_batch_size: int
    steps_per_rollout: int
    num_steps: int
    max_response_len: int
    max_turns: int


@dataclass(frozen=True)
class WeightSyncPlan:
    # weight_sync.transfer_mode; colocated engines always take the tensor hand-off (miles' colocated path), so
    # there it is "tensor" whatever the config says: tensor | broadcast | p2p | disk-delta
    transfer_mode: str
    pause_generation_mode: str
    flush_cache: bool
    update_weights_interval: int  # the adapter is pushed after every N steps, and after the last one
    verify: bool  # every engine's logprob gap on the push probe, checked right after each push (weight_sync/probe.py)
    max_logprob_gap: float
    # SGLang memory tags the engines release after each rollout and take back around the push (docs/system.md §7:
    # the weights before it, the rest after); empty: the engines stay resident.
    offload_tags: list[str] = field(default_factory=list)


def staleness_bound(update_weights_interval: int, schedule: str) -> int:
    """How many weight versions a trained batch can lag the trainer: the steps between pushes (interval - 1),
    plus one under the async schedule, whose next batch is generated while the current one trains."""
    return update_weights_interval - 1 + (schedule == "async")


def resolve_verify(verify: bool | None) -> bool:
    """weight_sync.verify, or when unset: on (the push probe compares the pushed weights under every driver)."""
    return True if verify is None else verify


# The mean |trainer - engine| probe logprob a healthy push stays within, by engine kind. The embedded engine runs the
# trainer's fp32 weights and kernels, so a healthy push matches to rounding, far below the gap of a stale or frozen
# adapter (bench/push_verification.py); SGLang's bf16 kernels differ from the trainer's (miles's CI allows 0.03 between
# their mean logprobs).
DEFAULT_MAX_LOGPROB_GAP = {"embedded": 0.01, "sglang": 0.05}


def resolve_max_logprob_gap(max_logprob_gap: float | None, engine_kind: str) -> float:
    return DEFAULT_MAX_LOGPROB_GAP[engine_kind] if max_logprob_gap is None else max_logprob_gap


@dataclass(frozen=True)
class Capabilities:
    lora_enabled: bool
    lora_rollout_enabled: bool
    multi_lora: bool
    use_routing_replay: bool
    use_addition_r3: bool
    offload_train: bool
    offload_rollout: bool
    normalize_advantages_by_std: bool
    use_dynamic_global_batch_size: bool


@dataclass(frozen=True)
class Plan:
    name: str
    recipe: str | None
    seed: int
    topology: str
    model: ModelConfig
    model_path: str
    cluster: ClusterPlan
    trainer: TrainerPlan
    engines: list[EnginePlan]
    router: RouterPlan | None
    session: SessionPlan | None
    multi_lora: MultiLoRAPlan | None
    adapters: list[AdapterSpec]
    batch: BatchPlan
    weight_sync: WeightSyncPlan
    capabilities: Capabilities
    rollout: RolloutConfig
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    checkpoint: CheckpointConfig
    executor: ExecutorConfig
    logger: LoggerConfig
    security: SecurityConfig = field(default_factory=SecurityConfig)  # the run's key: its variable's name only

    @property
    def staleness_bound(self) -> int:
        """The weight versions a trained batch may lag the trainer (`staleness_bound`)."""
        return staleness_bound(self.weight_sync.update_weights_interval, self.rollout.schedule)

    @property
    def rollout_url(self) -> str:
        """The router if there is one, else engine 0: the entry for calls any one engine may answer. Generation
        goes to an engine per prompt group or session instead (sglang_client/engine_pool.py), never through the
        router."""
        return self.router.launch.url if self.router else self.engines[0].launch.url


def server_launches(plan: Plan) -> list[tuple[str, Launch]]:
    """The servers an executor starts, by component name, in start order: engines (node rank 0 of each, then the
    other node ranks of those wider than a node), router, session server."""
    named = [(e.name, e.launch) for e in plan.engines]
    named += [(engine_rank_name(e.index, r.node_rank), r.launch) for e in plan.engines for r in e.node_ranks]
    if plan.router:
        named.append(("router", plan.router.launch))
    if plan.session:
        named.append(("session", plan.session.launch))
    return named


def plan_ports(plan: Plan) -> set[int]:
    """Every port the plan's servers bind, on whichever node: each server's own, the router's metrics port, and the
    rendezvous port of an engine that spans nodes with the DIST_INIT_EXTRA_PORTS after it (as the ports-distinct
    rule counts them). Read from the launches themselves: what binds is what their command lines say."""
    launches = [launch for _, launch in server_launches(plan)]
    if plan.multi_lora:
        launches.append(plan.multi_lora.launch)
    ports = {launch.port for launch in launches}
    ports.update(port for launch in launches for port in _argv_ports(launch.argv))
    ports.discard(0)
    return ports


def _argv_ports(argv: Sequence[str]) -> Iterator[int]:
    for flag, value in itertools.pairwise(argv):
        if flag.endswith("-port") and value.isdigit():
            yield int(value)
        elif flag == "--dist-init-addr":
            base = int(value.rsplit(":", 1)[1])
            yield from range(base, base + DIST_INIT_EXTRA_PORTS + 1)


def plan_on_nodes(plan: Plan, addresses: Sequence[str]) -> Plan:
    """The plan with the nodes' own addresses in place of their placeholders in every launch (a single-node plan
    comes back equal); read each component's node (Launch.node) from the plan before this."""
    return map_launches(plan, lambda launch: launch.on_nodes(addresses))


def plan_with_ports(plan: Plan, ports: Mapping[str, int]) -> Plan:
    """The plan with the ports chosen at start (`ports`, by name) in place of their placeholders in every launch."""
    return map_launches(plan, lambda launch: launch.with_ports(ports)) if ports else plan


def plan_launches(plan: Plan) -> list[Launch]:
    """Every server's launch: the executor's, and the multi-LoRA controller's."""
    return [launch for _, launch in named_launches(plan)]


def named_launches(plan: Plan) -> list[tuple[str, Launch]]:
    named = server_launches(plan)
    return [*named, (CONTROLLER, plan.multi_lora.launch)] if plan.multi_lora else named


def ports_to_choose(plan: Plan, names: Collection[str]) -> set[str]:
    """The ports still to be chosen where the components `names` run: their own, and the extra ports only their
    command lines name (the router's metrics port); never another component's, which is chosen where it runs."""
    named = dict(named_launches(plan))
    servers = {launch.port_name for launch in named.values()} - {""}
    mine = [named[name] for name in names if name in named]
    return {launch.port_name for launch in mine} - {""} | {
        extra for launch in mine for extra in launch.placeholders() if extra not in servers
    }


def map_launches(plan: Plan, change: Callable[[Launch], Launch]) -> Plan:
    """The plan with `change` applied to every server's launch."""
    replace = dataclasses.replace
    return replace(
        plan,
        engines=[e.mapped(change) for e in plan.engines],
        router=plan.router and replace(plan.router, launch=change(plan.router.launch)),
        session=plan.session and replace(plan.session, launch=change(plan.session.launch)),
        multi_lora=plan.multi_lora and replace(plan.multi_lora, launch=change(plan.multi_lora.launch)),
    )


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return dataclasses.asdict(plan)


def plan_from_dict(data: dict[str, Any]) -> Plan:
    return load_dataclass(Plan, data)
