"""Which devices (GPUs, or on a cpu-only cluster CPU worker processes) each role gets, and each engine's node ranks and
their ports.

One implementation: compile_plan builds the plan's placements and launches from these, and the rules check the
same layout and ports (an engine split unevenly over nodes, ports that collide), so a rule judges exactly what
would run.
"""

from __future__ import annotations

from miles_runner.config.schema import MilesConfig
from miles_runner.plan.derive import Derived

Device = tuple[int, int]  # (plan node, device on that node)
EngineLayout = dict[int, list[int]]  # an engine's device ids per node, in node order

# Engine i's node ranks rendezvous on engine.dist_init_port + DIST_INIT_PORT_STRIDE * i (SGLang --dist-init-addr);
# with DP attention SGLang also takes the DIST_INIT_EXTRA_PORTS next ports there for its sockets.
DIST_INIT_PORT_STRIDE = 10
DIST_INIT_EXTRA_PORTS = 6


def device_list(cfg: MilesConfig, d: Derived) -> list[Device]:
    """Every (node, device) of the cluster, node-major: the trainer takes the first ones."""
    return [(n, g) for n in range(cfg.cluster.nodes) for g in range(d.devices_per_node)]


def trainer_devices(d: Derived) -> list[Device]:
    return [(n, g) for n in range(d.trainer_nodes) for g in range(d.trainer_gpus_per_node)]


def rollout_devices(cfg: MilesConfig, d: Derived) -> list[Device]:
    """Colocated engines share the trainer's devices; disaggregated ones take the next free ones, node-major."""
    if d.colocated:
        return trainer_devices(d)
    taken = set(trainer_devices(d))
    return [dev for dev in device_list(cfg, d) if dev not in taken][: d.rollout_gpus]


def engine_layouts(cfg: MilesConfig, d: Derived) -> list[EngineLayout]:
    """Engine i takes the i-th run of engine.tp_size rollout devices; one node rank per node it touches."""
    return split_into_engines(rollout_devices(cfg, d), cfg.engine.tp_size, d.num_engines)


def split_into_engines(devices: list[Device], tp: int, count: int) -> list[EngineLayout]:
    layouts: list[EngineLayout] = []
    for index in range(count):
        layout: EngineLayout = {}
        for node, device in devices[index * tp : (index + 1) * tp]:
            layout.setdefault(node, []).append(device)
        layouts.append(layout)
    return layouts


def engine_rank_port(cfg: MilesConfig, d: Derived, index: int, rank: int) -> int:
    """Node rank `rank` of engine `index` serves on base_port + index + rank * num_engines: rank 0 (the engine's
    HTTP server) on base_port + index, each further rank (its stand-in /health) above every engine's rank 0, so
    ports stay distinct even where nodes share an address."""
    base = cfg.engine.base_port
    if not isinstance(base, int):
        raise ValueError("engine.base_port is chosen at start (auto): no engine port is numbered from it")
    return base + index + rank * d.num_engines


def engine_dist_init_port(cfg: MilesConfig, index: int) -> int:
    """Where engine `index`'s node ranks meet, on its rank 0's node."""
    return cfg.engine.dist_init_port + DIST_INIT_PORT_STRIDE * index
