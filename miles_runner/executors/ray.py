"""The Ray executor: the plan's servers run under one node agent actor per plan node, so Ray owns their
placement and lifetime.

Plan node K is the Ray node that offers the custom resource `miles_node_K` (core/cluster_nodes.py): the Slurm
job script starts each node with it, and the private Ray started here (no `executor.ray_address`, on loopback,
shut down after the run) offers `miles_node_0`. Start-up:

1. The plan's nodes are checked against the cluster's resources: a node nobody offers fails at once, naming it.
2. Placement groups reserve the plan's devices, per role and per node (`placement_bundles`): colocated trainer
   and engines share one group; disaggregated, the trainer and the engines get one each. Readiness is awaited
   within executor.health_timeout_s, else the run fails naming what the cluster could not give.
3. One node agent (`NodeAgentBody`, num_cpus=0, in a bundle of its node) per plan node reports its node's
   address; the plan's `{nodeK}` placeholders become those addresses. The driver (trainer rank 0) must be on
   node 0.
4. Every agent starts its node's engines (the local executor's start-up, for that node: node rank 0 of each
   engine placed there, and node ranks > 0 of SGLang engines wider than a node, which meet rank 0 at its node's
   address, `--dist-init-addr`; all agents start together so that an engine's ranks can meet), then node 0's agent
   starts the router and the session server. Trainer ranks on node K > 0 are started by node K's agent
   (`AgentRanks`) and join rank 0 at node 0's address.

Failure: a process that dies is named with its log tail (RUN_DIR/logs, shared by every node) by
`dead_components`, across all nodes; an agent lost with its node (RayActorError, a node removed) is a
ComponentFailure naming the node. `stop` stops every process of every node, and kills the agents: a killed
agent's children die with it (PR_SET_PDEATHSIG), so nothing of the run outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_runner.core.cluster_nodes import node_resource
from miles_runner.core.errors import ComponentFailure
from miles_runner.executors.local import Deployment, Executor, LocalExecutor
from miles_runner.plan.model import (
    Launch,
    Plan,
    plan_from_dict,
    plan_on_nodes,
    plan_to_dict,
    plan_with_ports,
    server_launches,
)
from miles_runner.plan.record import write_ports
from miles_runner.plan.secrets import key_environment, run_api_key
from miles_runner.procs.ports import LOOPBACK, address_answers
from miles_runner.procs.process import ManagedProcess
from miles_runner.procs.warm import WARM_START_ENV

logger = logging.getLogger(__name__)

AGENT_CALL_TIMEOUT_S = 60.0  # a node agent answers its bookkeeping calls at once; longer means it is gone
STOP_TIMEOUT_S = 20.0  # within Slurm's KillWait (30 s in scripts/slurm_local.sh), with room for the driver's exit
# Removing a placement group blocks for good once the GCS is gone; the GCS removes a job's groups when its driver
# leaves anyway, so the explicit removal (for a driver that goes on, such as a test process) gets a short bound.
GROUP_REMOVAL_TIMEOUT_S = 5.0
# ray.shutdown() flushes the driver's task events to the GCS, waiting up to Ray's default 5 s for a GCS that is gone
# (Slurm's SIGTERM takes the job's Ray with the run); an alive GCS takes the flush in milliseconds.
SHUTDOWN_FLUSH_ENV, SHUTDOWN_FLUSH_MS = "RAY_task_events_shutdown_flush_timeout_ms", "1000"


class ClusterNodesError(ComponentFailure):
    """The Ray cluster does not offer the nodes (or the devices on them) that the plan places components on."""


class NodeLostError(ComponentFailure):
    """A node agent is gone (its node left the cluster, or the actor died): its node's components with it."""


class NodeAgentBody:
    """What the Ray actor of one plan node does; a plain class so it reads (and tests) without Ray."""

    def __init__(self, plan_dict: dict[str, Any], run_dir: str, node: int, startup_timeout_s: float | None):
        # A node's processes are started here, on its node, as children of this agent: never forked by a warm start
        # server the driver's environment names (procs/warm.py), which lives on the driver's host.
        os.environ.pop(WARM_START_ENV, None)
        self.plan, self.run_dir, self.node = plan_from_dict(plan_dict), Path(run_dir), node
        self.startup_timeout_s = startup_timeout_s
        self.executor: LocalExecutor | None = None
        self.workers: dict[str, ManagedProcess] = {}  # trainer ranks, by name

    def where(self) -> dict[str, Any]:
        """This node's own address and Ray node id."""
        import ray

        return {
            "address": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        }

    def start_engines(self, addresses: list[str]) -> dict[str, int]:
        """Start this node's engines; returns the ports chosen here (this node's servers', by name)."""
        self.executor = LocalExecutor(
            self.plan, self.run_dir, startup_timeout_s=self.startup_timeout_s, node=self.node, addresses=addresses
        )
        self.executor.start_engines()
        return self.executor.ports

    def start_services(self, ports: dict[str, int]) -> dict[str, Any]:
        """Start this node's router and session server, given the ports every node chose; returns where the driver
        reaches the servers and every port known here."""
        assert self.executor is not None, "start_engines first"
        self.executor.start_services(ports)
        d = self.executor.deployment()
        return {
            "engine_urls": d.engine_urls,
            "rollout_url": d.rollout_url,
            "session_url": d.session_url,
            "ports": self.executor.ports,
        }

    def start_process(self, name: str, launch: Launch) -> int | None:
        assert self.executor is not None, "start_engines first"
        self.workers[name] = process = self.executor.start_process(name, launch)
        return process.pid

    def process_state(self, name: str) -> tuple[bool, int | None]:
        process = self.workers[name]
        return process.alive, process.returncode

    def stop_process(self, name: str) -> int | None:
        return self.workers[name].stop()

    def pids(self) -> dict[str, int | None]:
        """The pid of every process this agent started, by component name."""
        processes = self.executor.group.processes if self.executor else ()
        return {process.name: process.pid for process in processes}

    def stop(self) -> None:
        if self.executor is not None:
            self.executor.stop()

    def restart_dead_engines(self) -> list[int]:
        return self.executor.restart_dead_engines() if self.executor else []

    def dead_components(self) -> list[ComponentFailure]:
        return self.executor.dead_components() if self.executor else []


def agent_gone_errors() -> tuple[type[BaseException], ...]:
    """What a call on a node agent raises once the agent, or its node, is gone (or answers no more)."""
    import ray

    return ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.GetTimeoutError


@dataclass
class AgentHandle:
    """The driver's view of one node agent. `lost` is the error of the first call that found it gone: later calls
    fail at once with it, instead of each waiting for Ray to give up on a node it has not yet declared dead (each
    call would wait out Ray's retries of a removed node's address)."""

    node: int
    actor: Any
    address: str = ""
    node_id: str = ""
    lost: BaseException | None = None

    def call(self, method: str, *args: Any, timeout_s: float | None = AGENT_CALL_TIMEOUT_S) -> Any:
        """The agent's `method(*args)`, waited for; raises the agent-gone error (remembered) if it is gone."""
        return self.wait(getattr(self.actor, method).remote(*args), timeout_s)

    def wait(self, ref: Any, timeout_s: float | None = AGENT_CALL_TIMEOUT_S) -> Any:
        import ray

        if self.lost is not None:
            raise self.lost
        try:
            return ray.get(ref, timeout=timeout_s)
        except agent_gone_errors() as error:
            self.lost = error
            raise


class RemoteRank:
    """A trainer rank that a node agent started (trainer.ranks.Follower): liveness and stop go through the agent;
    a lost agent means a dead rank."""

    def __init__(self, agent: AgentHandle, name: str, log_path: Path) -> None:
        self.agent, self.name, self.log_path = agent, name, log_path

    def _state(self) -> tuple[bool, int | None]:
        import ray

        if not ray.is_initialized():  # the run's Ray is gone, and the agents with it
            return False, None
        try:
            return self.agent.call("process_state", self.name)
        except agent_gone_errors():  # the agent is gone (killed, or its node left): so is its rank
            return False, None

    @property
    def alive(self) -> bool:
        return self._state()[0]

    @property
    def returncode(self) -> int | None:
        return self._state()[1]

    def stop(self) -> int | None:
        import ray

        if not ray.is_initialized():
            return None
        try:
            return self.agent.call("stop_process", self.name)
        except agent_gone_errors():  # the agent is gone, and its processes died with it
            return None


class AgentRanks:
    """trainer.ranks.RemoteRanks: the node agents start the trainer ranks the plan places on their nodes."""

    def __init__(self, agents: list[AgentHandle], run_dir: Path) -> None:
        self.agents, self.run_dir = agents, run_dir
        self.master_address = agents[0].address

    def start_rank(self, name: str, node: int, launch: Launch) -> RemoteRank:
        agent = self.agents[node]
        agent.call("start_process", name, launch)
        return RemoteRank(agent, name, self.run_dir / "logs" / f"{name}.log")


def device_resource(plan: Plan) -> str:
    return "CPU" if plan.cluster.cpu_only else "GPU"


def placement_bundles(plan: Plan) -> dict[str, list[dict[str, float]]]:
    """The placement groups to reserve, by role: one bundle per device of a role, pinned to its plan node.
    Colocated, the trainer and the engines share their devices (one group); disaggregated, each role has its own."""
    resource = device_resource(plan)

    def bundles(devices: list[tuple[int, int]]) -> list[dict[str, float]]:
        return [{resource: 1, node_resource(node): 1} for node, _ in sorted(set(devices))]

    trainer = [(node, s) for node, s in plan.trainer.placements]
    engines = [device for e in plan.engines for device in e.placements()]  # every node rank's devices
    if plan.topology == "colocated":
        return {"trainer+engines": bundles(trainer + engines)}
    return {"trainer": bundles(trainer), "engines": bundles(engines)}


def services_bundle(node: int) -> dict[str, float]:
    """Where a node's agent goes when no role reserves devices on that node."""
    return {node_resource(node): 1}


class RayExecutor(Executor):
    def __init__(self, plan: Plan, run_dir: Path, *, startup_timeout_s: float | None = None):
        self.plan, self.run_dir, self.startup_timeout_s = plan, Path(run_dir), startup_timeout_s
        self.agents: list[AgentHandle] = []
        self.groups: list[Any] = []
        self.owns_ray = False
        self.pids: list[int] = []  # engines, router and session server of every node, in start order

    @property
    def timeout_s(self) -> float:
        return self.startup_timeout_s or self.plan.executor.health_timeout_s

    def start(self) -> Deployment:
        api_key = run_api_key(self.plan.security.api_key_env)  # a keyed run without its key starts nothing
        self._init_ray()
        try:
            self._check_nodes_offered()
            self.agents = self._place_agents()
            info = self._start_components()
        except BaseException:
            self.stop()
            raise
        addresses = [agent.address for agent in self.agents]
        return Deployment(
            plan_with_ports(plan_on_nodes(self.plan, addresses), info["ports"]),
            info["engine_urls"],
            info["rollout_url"],
            info["session_url"],
            remote_ranks=AgentRanks(self.agents, self.run_dir.resolve()),
            api_key=api_key,
            trainer_address=self.agents[0].address if len(self.agents) > 1 else LOOPBACK,
        )

    def _init_ray(self) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.plan.executor.ray_address or None
        own = {"num_cpus": max(self.plan.cluster.devices_per_node, 1), "resources": {node_resource(0): 1000}}
        handler = signal.getsignal(signal.SIGTERM)
        os.environ.setdefault(SHUTDOWN_FLUSH_ENV, SHUTDOWN_FLUSH_MS)  # read by the driver's core worker at ray.init
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **({} if address else own))
        if threading.current_thread() is threading.main_thread():
            # ray.init makes SIGTERM sys.exit() wherever the driver is (inside an asyncio task, say); the run's own
            # handler (cli/recorded_run: stop as Ctrl-C does) decides what SIGTERM means.
            signal.signal(signal.SIGTERM, handler)
        self.owns_ray = True

    def _check_nodes_offered(self) -> None:
        import ray

        offered = ray.cluster_resources()
        missing = [k for k in range(self.plan.cluster.nodes) if node_resource(k) not in offered]
        if missing:
            names = ", ".join(f"node {k} ({node_resource(k)})" for k in missing)
            raise ClusterNodesError(
                "ray cluster",
                f"the plan places components on {self.plan.cluster.nodes} node(s), but no Ray node "
                f"offers {names}. Each node of a run is started with its index: ray start --resources "
                f"'{{\"{node_resource(missing[0])}\": 1000}}' (the Slurm job script does this).",
            )

    def _place_agents(self) -> list[AgentHandle]:
        """Reserve the plan's devices, then put one agent on each plan node (into a bundle of that node)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        where: dict[int, tuple[Any, int]] = {}  # node -> (group, bundle index) its agent goes into
        for role, bundles in {**placement_bundles(self.plan), **self._service_bundles()}.items():
            group = placement_group(bundles, strategy="PACK", name=f"miles-{os.getpid()}-{role}")
            self.groups.append(group)
            self._wait_ready(group, role, bundles)
            for index, bundle in enumerate(bundles):
                node = next(k for k in range(self.plan.cluster.nodes) if node_resource(k) in bundle)
                where.setdefault(node, (group, index))
        agent_class = ray.remote(num_cpus=0, max_restarts=0)(NodeAgentBody)
        plan_dict, run_dir = plan_to_dict(self.plan), str(self.run_dir.resolve())
        agents = []
        for node in range(self.plan.cluster.nodes):
            group, index = where[node]
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            actor = agent_class.options(scheduling_strategy=strategy, runtime_env=key_runtime_env(self.plan)).remote(
                plan_dict, run_dir, node, self.startup_timeout_s
            )
            agents.append(AgentHandle(node, actor))
        for agent, info in zip(agents, self._gather([a.actor.where.remote() for a in agents], agents), strict=True):
            agent.address, agent.node_id = info["address"], info["node_id"]
        self._check_driver_on_node_0(agents[0])
        return agents

    def _service_bundles(self) -> dict[str, list[dict[str, float]]]:
        """A node where no role reserves devices (one that hosts only servers, or nothing) still gets its agent."""
        reserved = {
            node
            for bundles in placement_bundles(self.plan).values()
            for b in bundles
            for node in range(self.plan.cluster.nodes)
            if node_resource(node) in b
        }
        bare = sorted(set(range(self.plan.cluster.nodes)) - reserved)
        return {f"node{node}": [services_bundle(node)] for node in bare}

    def _wait_ready(self, group: Any, role: str, bundles: list[dict[str, float]]) -> None:
        import ray

        try:
            ray.get(group.ready(), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            need: dict[str, float] = {}
            for bundle in bundles:
                for key, amount in bundle.items():
                    need[key] = need.get(key, 0) + amount
            raise ClusterNodesError(
                "ray cluster",
                f"the {role} placement group ({need}) was not ready within {self.timeout_s:g} s; the "
                f"cluster has {ray.available_resources()} available. Give the nodes the plan's devices "
                "(cluster.cpu_devices_per_node / cluster.gpus_per_node) or free them.",
            ) from None

    def _check_driver_on_node_0(self, agent: AgentHandle) -> None:
        """The driver is trainer rank 0 (its address is the ranks' master address) and talks to a single-node
        plan's servers on loopback: it must be on plan node 0."""
        import ray

        here = ray.util.get_node_ip_address()
        if here != agent.address:
            raise ClusterNodesError(
                "driver",
                f"runs on {here}, but plan node 0 (the Ray node offering {node_resource(0)}) is "
                f"{agent.address}: start miles-run on node 0.",
            )

    def _start_components(self) -> dict[str, Any]:
        """Engines on every node (together), then the router and the session server on their node."""
        addresses = [agent.address for agent in self.agents]
        chosen: dict[str, int] = {}  # the ports chosen at start, each on the node of its server
        for ports in self._gather([a.actor.start_engines.remote(addresses) for a in self.agents], self.agents, None):
            chosen.update(ports)
        infos = self._gather([a.actor.start_services.remote(chosen) for a in self.agents], self.agents, timeout=None)
        for info in infos:
            chosen.update(info["ports"])
        write_ports(self.run_dir, chosen)
        self.pids = [pid for agent in self.agents for pid in self._pids(agent).values() if pid]
        return {**infos[0], "ports": chosen}

    def _pids(self, agent: AgentHandle) -> dict[str, int | None]:
        return agent.call("pids")

    def _gather(self, refs: list[Any], agents: list[AgentHandle], timeout: float | None = AGENT_CALL_TIMEOUT_S) -> list:
        """Every agent's answer; a component's failure raised in an agent is raised as is, a lost agent as a
        NodeLostError naming its node."""
        import ray

        answers = []
        for ref, agent in zip(refs, agents, strict=True):
            try:
                answers.append(agent.wait(ref, timeout))
            except ray.exceptions.RayTaskError as error:
                raise (error.cause if isinstance(error.cause, ComponentFailure) else error) from None
            except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError) as error:
                raise self.node_lost(agent, error) from None
        return answers

    def node_lost(self, agent: AgentHandle, error: BaseException) -> NodeLostError:
        on_node = [name for name, launch in server_launches(self.plan) if launch.node == agent.node]
        ranks = enumerate(self.plan.trainer.placements)
        on_node += [f"trainer{rank}" for rank, (node, _) in ranks if rank and node == agent.node]
        logs = self.run_dir / "logs"
        first = next((logs / f"{name}.log" for name in on_node if (logs / f"{name}.log").exists()), None)
        tail = "\n".join(first.read_text(errors="replace").splitlines()[-40:]) if first else ""
        where = f"{agent.address or 'address unknown'}, Ray node {agent.node_id[:12] or 'unknown'}"
        detail = (str(error).splitlines() or [""])[0][:200]
        reason = (
            f"the node agent of plan node {agent.node} ({where}) is gone, and {', '.join(on_node) or 'nothing'} "
            f"with it: {type(error).__name__}: {detail}"
        )
        return NodeLostError(f"node{agent.node}", reason, log_path=str(first) if first else None, log_tail=tail)

    def restart_dead_engines(self) -> list[int]:
        restarted = self._gather(
            [a.actor.restart_dead_engines.remote() for a in self.agents], self.agents, timeout=None
        )
        self.pids = [pid for agent in self.agents for pid in self._pids(agent).values() if pid]
        return sorted(index for indices in restarted for index in indices)

    def dead_components(self) -> list[ComponentFailure]:
        """The dead components of every node; a node whose agent is gone is one failure naming that node."""
        dead: list[ComponentFailure] = []
        for agent in self.agents:
            try:
                dead += agent.call("dead_components")
            except agent_gone_errors() as e:
                dead.append(self.node_lost(agent, e))
        return dead

    def stop(self) -> None:
        """Stop every process of every node (newest node's first), kill the agents, release the devices. Bounded:
        when the cluster itself is gone (Slurm's SIGTERM reaches the Ray daemons too) Ray's calls can block, and
        the agents' children die with them anyway (PR_SET_PDEATHSIG); the run must not outlast Slurm's KillWait."""
        import ray

        if not run_bounded(self._stop_agents, STOP_TIMEOUT_S):
            logger.warning("Ray did not answer within %.0f s while stopping: its cluster is gone", STOP_TIMEOUT_S)
        gcs = ray.get_runtime_context().gcs_address if self.groups else ""
        if gcs and not address_answers(gcs):  # a removal would block on it: the groups went with the GCS
            logger.warning("Ray's GCS at %s is gone, and the run's placement groups with it", gcs)
        elif not run_bounded(self._remove_groups, GROUP_REMOVAL_TIMEOUT_S):
            logger.warning(
                "Ray's GCS did not remove the placement groups within %.0f s: it is gone", GROUP_REMOVAL_TIMEOUT_S
            )
        self.agents, self.groups = [], []
        if self.owns_ray:
            ray.shutdown()
            self.owns_ray = False

    def _stop_agents(self) -> None:
        import ray

        stops = [agent.actor.stop.remote() if agent.lost is None else None for agent in self.agents]
        for agent, ref in zip(self.agents, stops, strict=True):
            try:
                agent.wait(ref)
            except Exception as error:  # a lost agent took its processes with it: go on
                logger.warning("node agent %d did not stop cleanly: %s", agent.node, error)
            ray.kill(agent.actor)

    def _remove_groups(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in self.groups:
            remove_placement_group(group)


def key_runtime_env(plan: Plan) -> dict[str, Any] | None:
    """The run's key for an actor on any node (its processes inherit the actor's environment). It travels in Ray's
    task spec: anyone who can reach the Ray cluster can read it (and run code there anyway), see SECURITY.md."""
    env = key_environment(plan.security.api_key_env)
    return {"env_vars": env} if env else None


def run_bounded(work: Callable[[], None], timeout_s: float) -> bool:
    """Run `work` in a daemon thread; False when it has not finished within `timeout_s` (it is left behind:
    it can only be blocked on a cluster that is gone). Its exception, if any, is raised here."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as error:  # handed to the caller's thread
            errors.append(error)

    thread = threading.Thread(target=target, name="ray-executor-stop", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()


def make_executor(plan: Plan, run_dir: Path) -> Executor:
    return RayExecutor(plan, run_dir) if plan.executor.kind == "ray" else LocalExecutor(plan, run_dir)
