"""Multi-node Ray placement on a simulated cluster: several Ray nodes on this machine (ray.cluster_utils.Cluster),
told apart by the custom resources miles_node_K that the Slurm job script gives real nodes, all on 127.0.0.1.

A scaled-down glm52-shaped plan (2 nodes, colocated, the session server behind the router, one engine and one
trainer rank per node) is placed node by node, runs the tiny model end to end with the same result as on one
node, and a node agent killed, or a node lost mid-run, fails the run naming that node and leaves nothing of the
run behind. A cluster without a planned node, or without its devices, fails before anything starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from miles_runner.config.compose import compose
from miles_runner.core.cluster_nodes import node_resource
from miles_runner.core.errors import ComponentFailure
from miles_runner.executors.ray import ClusterNodesError, NodeLostError, RayExecutor
from miles_runner.loops.run import run_plan
from miles_runner.plan.compile import compile_plan
from miles_runner.plan.model import Launch, Plan, plan_with_ports, server_launches
from miles_runner.plan.record import read_ports, write_run_record
from miles_runner.procs.ports import free_ports as distinct_ports
from miles_runner.procs.ports import port_is_free
from miles_runner.sglang_client.router import list_workers

pytestmark = pytest.mark.slow

# Greedy rollouts (top_k 1), one sample per prompt and REINFORCE++ (advantages normalised over the batch, not
# all zero as GRPO's would be with groups of one): nothing in the run is left to a sampler's RNG or to which
# engine served a session, so the one-node and the two-node runs can be compared step by step.
SHAPE = [
    "+recipe=tiny_lora_agentic_router",
    "topology.actor_num_gpus_per_node=1",
    "rollout.top_k=1",
    "rollout.n_samples_per_prompt=1",
    "algorithm.advantage_estimator=reinforce_plus_plus",
    "rollout.rollout_batch_size=8",
    "trainer.parallel.micro_batch_size=4",
    "logger=none",
]
TWO_NODES = ["cluster.nodes=2", "cluster.cpu_devices_per_node=1", "executor=ray"]
ONE_NODE = ["cluster.nodes=1", "cluster.cpu_devices_per_node=2", "topology.actor_num_gpus_per_node=2"]


def plan_of(*overrides: str) -> Plan:
    """The plan with its ports left to the executor (`auto`): each node's agent picks its servers' ports."""
    return compile_plan(compose([*SHAPE, *overrides]))


@contextmanager
def simulated_cluster(nodes: int, cpus_per_node: int = 1, gpus_per_node: int = 0) -> Iterator[object]:
    """`nodes` Ray nodes on 127.0.0.1, node K offering miles_node_K; the driver (this process) joins node 0.
    `gpus_per_node` are Ray's logical GPUs only (what a GPU plan's placement groups reserve): there is no GPU."""
    import ray
    from ray.cluster_utils import Cluster

    assert os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0", "Ray must stay on loopback in tests"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    cluster = Cluster()
    ports = iter(distinct_ports(3 * nodes + 1))  # distinct: Ray refuses a port given to two of its components
    try:
        for k in range(nodes):
            node_args = {
                "num_cpus": cpus_per_node,
                "num_gpus": gpus_per_node,
                "resources": {node_resource(k): 1000},
                "temp_dir": temp_dir,
                "node_ip_address": "127.0.0.1",
                "include_dashboard": False,
                "dashboard_agent_listen_port": next(ports),
                "metrics_export_port": next(ports),
                "runtime_env_agent_port": next(ports),
            }
            if k == 0:
                node_args["gcs_server_port"] = next(ports)
            cluster.add_node(**node_args)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[object]:
    """One simulated 2-node cluster for the module (a Ray cluster start is several seconds of CPU): each test gets
    it with every resource free again, so a test that leaked one fails the next. The node-loss test, which removes
    node 1, comes last."""
    with simulated_cluster(nodes=2) as cluster:
        yield cluster


@pytest.fixture
def cluster(two_nodes: object) -> Iterator[object]:
    import ray

    deadline = time.monotonic() + 30  # a placement group removed at the previous test's end frees its share soon
    while (free := ray.available_resources()) != (total := ray.cluster_resources()):
        assert time.monotonic() < deadline, f"the previous test left resources taken: {total} total, {free} free"
        time.sleep(0.2)
    yield two_nodes


def ray_node_of(resource: str) -> str:
    import ray

    [node_id] = [n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]
    return node_id


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def run_processes(plan: Plan, run_dir: Path) -> list[int]:
    """Live processes of the run: any whose command line names its run folder or one of its server ports."""
    marks = [str(run_dir.resolve()), *(f"--port\0{launch.port}\0" for _, launch in server_launches(plan))]
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_text()
        except OSError:
            continue
        if int(cmdline.parent.name) != os.getpid() and any(mark in text for mark in marks):
            found.append(int(cmdline.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def nothing_left(plan: Plan, run_dir: Path, also: Sequence[int] = (), timeout_s: float = 30) -> None:
    """No process of the run (nor the pids in `also`) is left, and none of its server ports is held."""
    plan = plan_with_ports(plan, read_ports(run_dir))  # the ports chosen at start
    deadline = time.monotonic() + timeout_s
    while (left := run_processes(plan, run_dir) + [p for p in also if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the run outlived it: {left}"
    busy = [(name, launch.port) for name, launch in server_launches(plan) if not port_is_free("127.0.0.1", launch.port)]
    assert not busy, f"ports of the run are still held: {busy}"


@pytest.mark.timeout(300)
def test_each_node_agent_starts_its_nodes_servers_on_its_node_and_a_killed_agent_is_named(tmp_path, cluster):
    import ray

    plan = plan_of(*TWO_NODES)
    assert [e.launch.host for e in plan.engines] == ["{node0}", "{node1}"]
    with (
        pytest.raises(NodeLostError) as lost,
        RayExecutor(plan, tmp_path, startup_timeout_s=180) as deployment,
    ):
        agents = deployment.remote_ranks.agents
        for k, agent in enumerate(agents):  # each agent landed on the Ray node that offers its plan node
            assert agent.node_id == ray_node_of(node_resource(k)), f"node {k}'s agent is elsewhere"
        agent_pids = [ray.get(agent.actor.where.remote())["pid"] for agent in agents]
        started = [ray.get(agent.actor.pids.remote()) for agent in agents]
        assert set(started[0]) == {"engine0", "router", "session"} and set(started[1]) == {"engine1"}
        for k, pids in enumerate(started):  # ...and started exactly its node's servers, as its own children
            assert all(parent_pid(pid) == agent_pids[k] for pid in pids.values()), (k, pids, agent_pids)
        # The addresses are the nodes' own (all 127.0.0.1 here), filled into the router's and session's flags.
        assert deployment.engine_urls == [f"http://127.0.0.1:{e.launch.port}" for e in deployment.plan.engines]
        assert deployment.trainer_address == agents[0].address  # where node 1's engine reaches the trainer
        assert sorted(asyncio.run(list_workers(deployment.rollout_url))) == sorted(deployment.engine_urls)
        assert httpx.get(deployment.session_url + "/health", timeout=10, trust_env=False).status_code == 200
        # A trainer rank placed on node 1 is started by node 1's agent.
        rank = deployment.remote_ranks.start_rank("trainer1", 1, sleeper())
        rank_pid = ray.get(agents[1].actor.pids.remote())["trainer1"]
        assert rank.alive and parent_pid(rank_pid) == agent_pids[1]
        # Injected fault: node 1's agent dies; the run then fails somewhere (here: as soon as the agent is gone,
        # ray.kill being asynchronous), and the executor names the lost node instead of that symptom.
        ray.kill(agents[1].actor)
        wait_gone(agents[1].actor)
        raise RuntimeError("a rollout failed: engine1 refused the connection")
    assert lost.value.component == "node1", lost.value.report()
    assert "engine1, trainer1" in lost.value.reason
    # The handle remembers its agent is gone: a later call raises that error at once, with no call to Ray that
    # would wait for it to give up on the node (the executor's stop, the rank's liveness and stop all ask again).
    assert isinstance(agents[1].lost, ray.exceptions.RayActorError) and agents[0].lost is None
    with pytest.raises(ray.exceptions.RayActorError) as again:
        agents[1].call("pids")
    assert again.value is agents[1].lost
    nothing_left(plan, tmp_path, also=[rank_pid])


def wait_gone(actor: object, timeout_s: float = 30) -> None:
    """Until a killed actor answers no more (its calls fail with RayActorError)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.where.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answers after {timeout_s:.0f} s")


def sleeper() -> Launch:
    return Launch(["python", "-c", "import time; time.sleep(600)"], health_path="")


@pytest.mark.timeout(180)
def test_a_cluster_without_a_planned_node_or_its_devices_fails_fast_naming_what_is_missing(tmp_path, cluster):
    three_nodes = plan_of(
        "cluster.nodes=3", "cluster.cpu_devices_per_node=1", "executor=ray", "topology.actor_num_nodes=2"
    )
    two_devices_each = plan_of(*TWO_NODES, "cluster.cpu_devices_per_node=2", "topology.actor_num_gpus_per_node=2")
    with pytest.raises(ClusterNodesError) as missing:
        RayExecutor(three_nodes, tmp_path, startup_timeout_s=30).start()
    with pytest.raises(ClusterNodesError) as too_small:  # the nodes are there, with one CPU each
        RayExecutor(two_devices_each, tmp_path, startup_timeout_s=5).start()
    assert missing.value.component == "ray cluster"
    assert "node 2 (miles_node_2)" in missing.value.reason and "node 1" not in missing.value.reason
    assert "trainer+engines placement group" in too_small.value.reason and "within 5 s" in too_small.value.reason
    assert not (tmp_path / "logs").exists(), "something was started"


def run(plan: Plan, run_dir: Path, overrides: list[str]) -> list[dict]:
    write_run_record(run_dir, compose(overrides), plan, overrides)
    return run_plan(plan, run_dir)


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    [weights] = (run_dir / "adapter").glob("*.safetensors")
    return load_file(weights)


@pytest.mark.timeout(1200)
def test_the_glm52_shaped_plan_runs_on_two_nodes_with_the_same_result_as_on_one(tmp_path, cluster):
    steps = ["algorithm.num_steps=2"]
    one = plan_of(*ONE_NODE, *steps)
    one_records = run(one, tmp_path / "one", [*SHAPE, *ONE_NODE, *steps])
    two = plan_of(*TWO_NODES, *steps)
    two_records = run(two, tmp_path / "two", [*SHAPE, *TWO_NODES, *steps])
    nothing_left(two, tmp_path / "two")

    assert [r["step"] for r in two_records] == [0, 1]
    # Greedy tokens: the same episodes, so the same rewards, step by step (step 1 under the trained adapter).
    for key in ("reward/mean", "rollout/tokens"):
        assert [r[key] for r in two_records] == [r[key] for r in one_records], key
    # The trainer ranks met across nodes: the same loss and the same adapter. Not bit for bit: an engine's CPU
    # kernels differ in the last bits with the batch it runs (which sessions share it is timing), and the loss
    # takes the rollout logprobs.
    for mine, theirs in zip(two_records, one_records, strict=True):
        for key in ("train/loss", "train/grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], abs=1e-5), key
    a, b = adapter(tmp_path / "two"), adapter(tmp_path / "one")
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    assert any(b[k].abs().sum() > 0 for k in b if "lora_B" in k), "the adapter never trained: nothing compared"


@pytest.mark.timeout(600)
def test_a_node_lost_mid_run_fails_the_run_naming_it_and_leaves_nothing_running(tmp_path, cluster):
    overrides = [*SHAPE, *TWO_NODES, "algorithm.num_steps=50"]
    plan = plan_of(*TWO_NODES, "algorithm.num_steps=50")
    run_dir = tmp_path / "run"
    [worker] = list(cluster.worker_nodes)

    def remove_node_after_the_first_step() -> None:
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            time.sleep(0.2)
        cluster.remove_node(worker, allow_graceful=False)  # node 1: its raylet, agent and workers die

    fault = threading.Thread(target=remove_node_after_the_first_step, daemon=True)
    fault.start()
    with pytest.raises(ComponentFailure) as failure:
        run(plan, run_dir, overrides)
    fault.join(timeout=60)
    assert failure.value.component == "node1", failure.value.report()
    assert "engine1" in failure.value.reason and "trainer1" in failure.value.reason
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 0
    nothing_left(plan, run_dir)
