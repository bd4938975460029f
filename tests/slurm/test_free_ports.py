"""The job script's Ray ports (`python -m miles_runner.slurm.free_ports N --plan PLAN`), picked on the node at every
attempt of a job: never a port that the job's plan binds once its Ray is up. A requeued job's session server found
its port taken when that pick could land on it."""

from __future__ import annotations

import pytest

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.devices import DIST_INIT_EXTRA_PORTS
from miles_runner.plan.model import plan_ports
from miles_runner.plan.record import write_run_record
from miles_runner.procs import ports
from miles_runner.procs.ports import free_port_block
from miles_runner.slurm import free_ports


def router_plan_overrides(base: int) -> list[str]:
    """The router recipe (two engines, router, metrics, session) on the ports base .. base + 4."""
    return [
        "+recipe=tiny_lora_agentic_router",
        f"engine.base_port={base}",
        f"session.port={base + 2}",
        f"router.port={base + 3}",
        f"router.metrics_port={base + 4}",
    ]


def test_a_plans_ports_are_its_servers_and_the_routers_metrics_port():
    plan = compile_plan(compose(router_plan_overrides(31000)))
    assert plan_ports(plan) == {31000, 31001, 31002, 31003, 31004}


def test_an_engine_spanning_nodes_also_claims_its_rendezvous_ports():
    overrides = [
        "cluster=gpu_1x",
        "cluster.nodes=2",
        "engine=sglang",
        "engine.tp_size=2",
        "executor=ray",
        "engine.base_port=31000",
        "engine.dist_init_port=32000",
    ]
    plan = compile_design(compose(overrides))
    assert set(range(32000, 32001 + DIST_INIT_EXTRA_PORTS)) <= plan_ports(plan)
    assert {31000, 31001} <= plan_ports(plan)  # node rank 0's server, node rank 1's stand-in /health


def test_the_job_script_never_hands_ray_a_port_of_its_plan(tmp_path, monkeypatch, capsys):
    base = free_port_block(6)
    overrides = router_plan_overrides(base)
    composed = compose(overrides)
    write_run_record(tmp_path, composed, compile_plan(composed), overrides)
    monkeypatch.setattr(ports, "listen_port_range", lambda: range(base, base + 6))
    monkeypatch.setattr(ports, "_handed_out", set())
    free_ports.main(["1", "--plan", str(tmp_path / "plan.yaml")])
    assert capsys.readouterr().out.split() == [str(base + 5)]  # the one port of the range the plan leaves
    with pytest.raises(RuntimeError, match="no block of 1 free"):
        free_ports.main(["1", "--plan", str(tmp_path / "plan.yaml")])
