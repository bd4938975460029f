"""The local executor: starts the plan's servers on this machine, in order, health-checked, and stops them all.

Engines (started together, then each waited for) -> router -> session server. The trainer runs in the
driver's own process. Whatever happens (success, an exception, Ctrl-C), every process started is stopped,
newest first; ports are checked before anything starts, so a busy port fails fast with its name.

The Ray executor's node agents run the same start-up for one node each of a plan that spans nodes (`node`,
`addresses`): the node's engines (`start_engines`, on every node first), then the router and the session
server where the plan puts them (`start_services`), with the nodes' own addresses in place of the plan's
`{nodeK}` placeholders; they also adopt the trainer ranks placed on their node (`start_process`).

An engine that dies mid-run is started again on the same port by `restart_dead_engines`, at most
`executor.engine_restarts` times each (and registered with the router again); it comes back without adapters,
which the driver notices from its weight version and pushes again. An SGLang engine wider than a node is one
launch per node rank (`EnginePlan.node_ranks`, `engine<i>-node-rank<R>`); a dead rank is that engine's death,
named, and is not restarted (its ranks meet only at start-up).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from miles_runner.core.errors import ComponentFailure
from miles_runner.models.tiny_model import ensure_tiny_model
from miles_runner.plan.derive import TINY_MODEL_SEED, parse_tiny_model
from miles_runner.plan.model import (
    EnginePlan,
    Launch,
    Plan,
    engine_rank_name,
    plan_on_nodes,
    plan_with_ports,
    ports_to_choose,
    server_launches,
)
from miles_runner.plan.model_shape import checkpoint_config, describe_mismatches, shape_mismatches
from miles_runner.plan.record import write_ports
from miles_runner.plan.secrets import run_api_key
from miles_runner.procs.launch import check_ports, launch_process
from miles_runner.procs.listeners import listener_owners
from miles_runner.procs.ports import ANY_ADDRESS, LOOPBACK, free_ports, port_holders, port_is_free
from miles_runner.procs.process import ManagedProcess, ProcessGroup
from miles_runner.sglang_client.router import ensure_worker, wait_for_workers

logger = logging.getLogger(__name__)

# How long a dead engine's own processes may keep its port after it was stopped: as long as a stop waits for them.
PORT_RELEASE_TIMEOUT_S = 10.0


class EngineLostError(ComponentFailure):
    """An engine died and may not be restarted (`executor.engine_restarts` is used up)."""


@dataclass
class Deployment:
    """What the driver talks to once everything is up."""

    plan: Plan  # the plan as it runs: every port chosen at start filled in (what RUN_DIR/ports.json records)
    engine_urls: list[str]
    rollout_url: str  # the router, else the only engine
    session_url: str | None
    processes: list[ManagedProcess] = field(default_factory=list)
    # Starts the trainer ranks placed on other nodes (trainer.ranks.RemoteRanks); None on one node.
    remote_ranks: Any = None
    # The run's key (security.api_key_env): every server requires it, so every client the driver makes sends it.
    api_key: str | None = field(default=None, repr=False)
    # Where the engines reach the trainer (rank 0's weight-update store): loopback on one node, node 0's own
    # address when the plan's engines run on other nodes (the store listens on exactly that address).
    trainer_address: str = LOOPBACK


class Executor:
    """Start the plan's servers on enter, stop every one of them on exit (whatever ended the block)."""

    def start(self) -> Deployment:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def restart_dead_engines(self) -> list[int]:
        """Start again each engine that died; returns their indices. Raises EngineLostError past the limit."""
        raise NotImplementedError

    def dead_components(self) -> list[ComponentFailure]:
        """The started components that have exited, each with its exit code and log tail."""
        raise NotImplementedError

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        # A run that failed because a server died usually fails somewhere else first (a refused connection in
        # the rollout): name the dead component instead, with its log, before stopping the others.
        dead = self.dead_components() if isinstance(exc, Exception) and not isinstance(exc, ComponentFailure) else []
        self.stop()
        if dead:
            raise dead[0] from exc


class LocalExecutor(Executor):
    """The plan's servers on this machine; with `node`, only those the plan puts on that node (a node agent's
    share of a plan that spans nodes, whose `{nodeK}` placeholders become `addresses[K]`)."""

    def __init__(
        self,
        plan: Plan,
        run_dir: Path,
        *,
        startup_timeout_s: float | None = None,
        node: int | None = None,
        addresses: Sequence[str] = (LOOPBACK,),
    ):
        self.plan = plan_on_nodes(plan, addresses)  # what runs: the nodes' own addresses, then the ports chosen
        self.mine = {name for name, launch in server_launches(plan) if node is None or launch.node == node}
        self.ports: dict[str, int] = {}  # chosen at start (here, or by the agents of the other nodes)
        self.run_dir = Path(run_dir)
        self.timeout_override = startup_timeout_s  # else each component's own timeout, from the plan
        self.startup_timeout_s = startup_timeout_s or plan.executor.health_timeout_s
        self.group = ProcessGroup()
        self.engines: dict[int, ManagedProcess] = {}  # by engine index, the current process of each of mine
        self.ranks: dict[str, ManagedProcess] = {}  # node ranks > 0 of engines wider than a node, by name
        self.engine_names = {e.name for e in plan.engines}
        self.restarts = [0] * len(plan.engines)
        self.api_key: str | None = None  # read from the environment at start (a missing key starts nothing)

    def launches(self) -> list[tuple[str, Launch]]:
        return [(name, launch) for name, launch in server_launches(self.plan) if name in self.mine]

    def use_ports(self, ports: Mapping[str, int]) -> None:
        """Fill in ports chosen at start (by the agents of other nodes, or here)."""
        self.ports.update(ports)
        self.plan = plan_with_ports(self.plan, ports)

    def choose_ports(self, names: Collection[str]) -> None:
        """Pick a free port for each port of the components `names` still to be chosen ("auto"), here, where they
        will bind it: free on every address of this host, and never one this process handed out before."""
        wanted = sorted(ports_to_choose(self.plan, [name for name in names if name in self.mine]))
        self.use_ports(dict(zip(wanted, free_ports(len(wanted), ANY_ADDRESS), strict=True)))

    def check_ports(self) -> None:
        check_ports(self.launches())

    def prepare_model(self) -> None:
        """Build the tiny model the plan names, if that is what it names and it is not cached yet: in the cache
        folder the plan was compiled with (a resumed run may have another MILES_CACHE_DIR now)."""
        if tiny := parse_tiny_model(self.plan.model.path):
            # Imported here: format pre-training needs torch, which a node agent (a Ray actor that only starts
            # processes) otherwise never loads.
            from miles_runner.models.format_pretrain import ensure_format_pretrained

            name, pretrained = tiny
            cache = Path(self.plan.model_path).parent
            if pretrained:
                built = ensure_format_pretrained(name, TINY_MODEL_SEED, cache)
            else:
                built = ensure_tiny_model(name, cache, TINY_MODEL_SEED)
            if str(built) != self.plan.model_path:
                raise RuntimeError(f"tiny model built at {built}, but the plan expects {self.plan.model_path}")
        self.check_model_shape()

    def check_model_shape(self) -> None:
        """The checkpoint on disk is the model the plan describes (the plan could check it only if it was there)."""
        config = checkpoint_config(self.plan.model_path, None)
        if config and (found := shape_mismatches(self.plan.model, config)):
            raise RuntimeError(
                f"{self.plan.model_path} is not the model the plan describes: {describe_mismatches(found)}"
            )

    def process(self, name: str, launch: Launch, startup_timeout_s: float | None = None) -> ManagedProcess:
        timeout = startup_timeout_s or self.startup_timeout_s
        return launch_process(name, launch, self.run_dir / "logs", startup_timeout_s=timeout)

    def engine_processes(self) -> dict[str, ManagedProcess]:
        """This node's engine processes, by component name: node rank 0 of each engine placed here, and the node
        ranks > 0 of engines wider than a node. An engine may take engine.startup_timeout_s to become healthy (it
        loads the model), not the executor.health_timeout_s of the other components; a rank > 0 answers SGLang's
        stand-in /health on its own port once its schedulers are up, so every rank is waited for the same way."""
        timeout = {
            name: self.timeout_override or e.startup_timeout_s
            for e in self.plan.engines
            for name in (e.name, *(engine_rank_name(e.index, r.node_rank) for r in e.node_ranks))
        }
        return {name: self.process(name, launch, timeout[name]) for name, launch in self.launches() if name in timeout}

    def engine_process(self, engine: EnginePlan) -> ManagedProcess:
        """Node rank 0 of `engine`, started again on its port (see engine_processes for its timeout)."""
        return self.process(engine.name, engine.launch, self.timeout_override or engine.startup_timeout_s)

    def start(self) -> Deployment:
        self.start_engines()
        self.start_services()
        write_ports(self.run_dir, self.ports)
        return self.deployment()

    def start_engines(self) -> None:
        """Check every port of this node's components, build the model if needed, and start this node's engine
        ranks together (their model loads overlap; the ranks of an engine wider than a node meet while loading),
        each healthy before this returns."""
        self.api_key = run_api_key(self.plan.security.api_key_env)
        self.choose_ports([name for name, _ in self.launches()])
        self.check_ports()
        self.prepare_model()
        processes = self.engine_processes()
        try:
            for process in processes.values():
                process.start()
            for process in processes.values():
                process.wait_healthy()
                self.group.adopt(process)
        except BaseException:
            for process in processes.values():
                process.stop()
            self.group.stop()
            raise
        self.engines = {e.index: processes[e.name] for e in self.plan.engines if e.name in processes}
        self.ranks = {name: process for name, process in processes.items() if name not in self.engine_names}

    def start_services(self, ports: Mapping[str, int] | None = None) -> None:
        """The router and the session server, if on this node, once every engine (of every node) is healthy and
        its port (`ports`: those the other nodes chose) is known."""
        self.use_ports(ports or {})
        try:
            for name, launch in self.launches():
                if name.startswith("engine"):
                    continue
                self.group.start(process := self.process(name, launch))
                if name == "router":  # it answers /health at once, but drops engines it could not reach
                    wait_for_workers(
                        process,
                        launch.url,
                        [e.launch.url for e in self.plan.engines],
                        self.startup_timeout_s,
                        api_key=self.api_key,
                    )
        except BaseException:
            self.group.stop()
            raise

    def deployment(self) -> Deployment:
        plan = self.plan
        return Deployment(
            plan=plan,
            engine_urls=[e.launch.url for e in plan.engines],
            rollout_url=plan.rollout_url,
            session_url=plan.session.launch.url if plan.session else None,
            processes=list(self.group.processes),
            api_key=self.api_key,
        )

    def start_process(self, name: str, launch: Launch) -> ManagedProcess:
        """Start a worker of the run on this node (a trainer rank: no health check), stopped with the rest."""
        return self.group.adopt(launch_process(name, launch, self.run_dir / "logs", startup_timeout_s=0).start())

    def stop(self) -> None:
        self.group.stop()

    def dead_components(self) -> list[ComponentFailure]:
        return [failure for process in self.group.processes if (failure := process.died())]

    def restart_dead_engines(self) -> list[int]:
        """Restart each dead engine of mine in place. An engine wider than a node is refused instead: SGLang's
        node ranks meet only at start-up, so one dead rank takes the engine down and all its ranks, on every
        node, would have to start again together."""
        for name, rank in self.ranks.items():
            if not rank.alive:
                raise self._multi_node_engine_lost(name, rank)
        restarted = [index for index, engine in self.engines.items() if not engine.alive]
        for index in restarted:
            if self.plan.engines[index].node_ranks:
                raise self._multi_node_engine_lost(f"engine{index}", self.engines[index])
            self._restart_engine(index)
        return restarted

    def _multi_node_engine_lost(self, name: str, dead: ManagedProcess) -> EngineLostError:
        return EngineLostError(
            name,
            f"exited with code {dead.returncode}; it is a node rank of an SGLang engine that spans nodes "
            "(--nnodes), which goes down with any of its ranks and is not restarted (all its ranks would have to "
            "start again together). Fit each engine in one node (engine.tp_size <= cluster.gpus_per_node) to let "
            "executor.engine_restarts restart it.",
            log_path=str(dead.log_path),
            log_tail=dead.log_tail(),
        )

    def _restart_engine(self, index: int) -> None:
        dead, engine = self.engines[index], self.plan.engines[index]
        code = dead.returncode
        limit = self.plan.executor.engine_restarts
        if self.restarts[index] >= limit:
            raise EngineLostError(
                f"engine{index}",
                f"({engine.launch.url}) exited with code {code} and executor.engine_restarts={limit} restart(s) "
                "are used up. Raise executor.engine_restarts to let the run go on.",
                log_path=str(dead.log_path),
                log_tail=dead.log_tail(),
            )
        self.restarts[index] += 1
        logger.warning("engine%d exited with code %s; restart %d of %d", index, code, self.restarts[index], limit)
        group = dead.pid  # the dead engine led its own process group
        dead.stop()  # reaps it, and whatever of its process group is left
        _wait_port_released(dead, f"engine{index}", engine.launch, group)
        self.engines[index] = self.group.replace(dead, self.engine_process(engine))
        if self.plan.router:
            ensure_worker(self.plan.router.launch.url, engine.launch.url, self.startup_timeout_s, api_key=self.api_key)


def _wait_port_released(dead: ManagedProcess, name: str, launch: Launch, group: int | None) -> None:
    """Wait while only the dead server's own processes hold its port: stop() takes a process of the group for gone
    once its main thread has exited, while its other threads may still hold its files open. A listener of anyone
    else took the port meanwhile and will not let go: EngineLostError names it at once."""
    host, port = launch.host, launch.port
    deadline = time.monotonic() + PORT_RELEASE_TIMEOUT_S
    while not port_is_free(host, port):
        owners = listener_owners(host, port, group) if group else None
        if (owners and owners.others) or time.monotonic() >= deadline:
            holders = list(owners.others) if owners and owners.others else port_holders(port)
            raise EngineLostError(
                name,
                f"died, but its port {port} is still held" + (f" by {'; '.join(holders)}" if holders else ""),
                log_path=str(dead.log_path),
                log_tail=dead.log_tail(),
            )
        time.sleep(0.05)
