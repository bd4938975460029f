"""Ports chosen at start ("auto", the default): the plan names them by placeholder, each is chosen where its server
runs, and filling them in gives the plan as it runs; a number still pins a port."""

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.errors import PlanError
from miles_runner.plan.compile import compile_design, compile_plan
from miles_runner.plan.model import ROUTER_METRICS, plan_with_ports, ports_to_choose
from miles_runner.plan.summary import summarize

ROUTER_RECIPE = "+recipe=tiny_lora_agentic_router"  # two engines, the router, a session server


def test_a_default_plan_names_every_server_port_by_placeholder():
    plan = compile_plan(compose([ROUTER_RECIPE]))
    assert [e.launch.port for e in plan.engines] == [0, 0]
    assert plan.engines[1].launch.url == "http://127.0.0.1:{port:engine1}"
    router_argv = plan.router.launch.argv
    assert "http://127.0.0.1:{port:engine0}" in router_argv and "{port:router-metrics}" in router_argv
    assert "--engine-url" not in plan.session.launch.argv  # behind the router: its URL, a placeholder too
    assert "http://127.0.0.1:{port:router}" in plan.session.launch.argv
    assert "session    v1 on :auto" in summarize(plan, "plan.yaml")


def test_each_node_chooses_its_own_servers_ports_and_the_router_its_metrics_port():
    plan = compile_plan(compose([ROUTER_RECIPE]))
    assert ports_to_choose(plan, ["engine0"]) == {"engine0"}
    # The router's command line names both engines, but their ports are chosen where the engines run.
    assert ports_to_choose(plan, ["router", "session"]) == {"router", ROUTER_METRICS, "session"}


def test_filling_in_the_chosen_ports_gives_the_plan_as_it_runs():
    plan = compile_plan(compose([ROUTER_RECIPE]))
    ports = {"engine0": 20001, "engine1": 20002, "router": 20003, ROUTER_METRICS: 20004, "session": 20005}
    running = plan_with_ports(plan, ports)
    assert [e.launch.url for e in running.engines] == ["http://127.0.0.1:20001", "http://127.0.0.1:20002"]
    assert running.router.launch.port == 20003 and not running.router.launch.port_name
    assert "http://127.0.0.1:20002" in running.router.launch.argv and "20004" in running.router.launch.argv
    assert "http://127.0.0.1:20003" in running.session.launch.argv
    assert not any("{port:" in arg for e in running.engines for arg in e.launch.argv)


def test_a_fixed_base_port_numbers_the_engines_as_before():
    plan = compile_plan(compose([ROUTER_RECIPE, "engine.base_port=30010", "session.port=30001"]))
    assert [e.launch.port for e in plan.engines] == [30010, 30011]
    assert plan.session.launch.port == 30001 and "30001" in plan.session.launch.argv
    assert plan.router.launch.port_name == "router"  # still chosen at start: only what is set is pinned


def test_a_wider_engines_node_ranks_each_choose_a_port():
    plan = compile_design(compose(["+recipe=glm52_lora_agentic"]))
    [rank] = plan.engines[0].node_ranks
    assert rank.launch.port_name == "engine0-node-rank1"


@pytest.mark.parametrize("value", ["atuo", "-"])
def test_a_port_that_is_neither_a_number_nor_auto_is_refused_naming_both(value):
    with pytest.raises(PlanError) as info:
        compose([f"session.port={value}"])
    [problem] = info.value.problems
    assert problem.settings[0][0] == "session.port" and "expected int or 'auto'" in problem.reason
