"""An SGLang engine wider than a node, on the simulated 2-node Ray cluster of test_multi_node_ray: each node's
agent starts the engine's node rank placed on its node, with the nodes' addresses filled in, and a dead rank > 0
is named as that engine's death (not restarted: SGLang's ranks meet only at start-up).

The engine is a FAKE (fake_sglang_node_rank.py) run with the plan's own SGLang flags: it records its argv, meets
the other ranks at --dist-init-addr as SGLang's do, and serves /health on its own address and port."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from miles_runner.config.compose import compose
from miles_runner.executors.local import EngineLostError
from miles_runner.executors.ray import RayExecutor
from miles_runner.plan.compile import compile_design
from miles_runner.plan.model import Launch, Plan
from miles_runner.procs.ports import free_port, free_port_block, port_is_free

from .test_multi_node_ray import parent_pid, simulated_cluster

pytestmark = pytest.mark.slow

FAKE_SGLANG = Path(__file__).with_name("fake_sglang_node_rank.py")
# Two nodes of one GPU, one engine of TP 2 over both: node rank 0 on node 0, node rank 1 on node 1. A GPU plan is
# compiled as a design (its trainer is not built yet); only its engines run here.
TWO_GPU_NODES = ["cluster=gpu_1x", "cluster.nodes=2", "engine=sglang", "engine.tp_size=2", "executor=ray"]


def fake_sglang(launch: Launch) -> Launch:
    assert launch.argv[:3] == ["python", "-m", "sglang.launch_server"], launch.argv
    return dataclasses.replace(launch, argv=["python", str(FAKE_SGLANG), *launch.argv[3:]])


def with_fake_engines(plan: Plan) -> Plan:
    engines = [
        dataclasses.replace(
            e,
            launch=fake_sglang(e.launch),
            node_ranks=[dataclasses.replace(r, launch=fake_sglang(r.launch)) for r in e.node_ranks],
        )
        for e in plan.engines
    ]
    return dataclasses.replace(plan, engines=engines)


def recorded(log: Path) -> dict:
    """What the fake printed first (the log opens with the launcher's own header line)."""
    return json.loads(next(line for line in log.read_text().splitlines() if line.startswith("{")))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.timeout(300)
def test_each_node_agent_starts_its_rank_of_an_engine_wider_than_a_node_and_a_dead_rank_names_it(tmp_path):
    import ray

    base, dist_init = free_port_block(2), free_port()
    plan = compile_design(compose([*TWO_GPU_NODES, f"engine.base_port={base}", f"engine.dist_init_port={dist_init}"]))
    [engine] = plan.engines
    assert (engine.nodes, [r.node for r in engine.node_ranks]) == ([0, 1], [1])
    executor = RayExecutor(with_fake_engines(plan), tmp_path, startup_timeout_s=120)
    with simulated_cluster(nodes=2, gpus_per_node=1), executor as deployment:
        agents = deployment.remote_ranks.agents
        agent_pids = [ray.get(agent.actor.where.remote())["pid"] for agent in agents]
        started = [ray.get(agent.actor.pids.remote()) for agent in agents]
        assert [set(pids) for pids in started] == [{"engine0"}, {"engine0-node-rank1"}]
        for k, pids in enumerate(started):  # each rank is a child of its own node's agent
            assert all(parent_pid(pid) == agent_pids[k] for pid in pids.values()), (k, pids, agent_pids)
        logs = tmp_path / "logs"
        ranks = [recorded(logs / "engine0.log"), recorded(logs / "engine0-node-rank1.log")]
        for rank, (seen, port) in enumerate(zip(ranks, (base, base + 1), strict=True)):
            argv = seen["argv"]
            assert (flag(argv, "--nnodes"), flag(argv, "--node-rank")) == ("2", str(rank))
            # the nodes' own addresses (all 127.0.0.1 here) in place of {node0} / {node1}
            assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", str(port))
            assert flag(argv, "--dist-init-addr") == f"127.0.0.1:{dist_init}"
            assert seen["cuda_visible_devices"] == "0"  # GPU 0 of each node
        assert all("met 1 peer(s)" in (logs / f"{name}.log").read_text() for name in ("engine0", "engine0-node-rank1"))
        assert deployment.engine_urls == deployment.rollout_url.split() == [f"http://127.0.0.1:{base}"]

        os.kill(started[1]["engine0-node-rank1"], signal.SIGKILL)  # injected fault: node rank 1 dies
        deadline = time.monotonic() + 60
        while not (dead := executor.dead_components()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [failure.component for failure in dead] == ["engine0-node-rank1"]
        with pytest.raises(EngineLostError) as lost:
            executor.restart_dead_engines()
        assert lost.value.component == "engine0-node-rank1"
        assert "spans nodes" in lost.value.reason and "engine.tp_size" in lost.value.reason
    assert port_is_free("127.0.0.1", base) and port_is_free("127.0.0.1", dist_init)
