"""The plan summary's per-node rows: what each node of a plan that spans nodes runs, engine node ranks included."""

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_design
from miles_runner.plan.summary import node_lines, summarize


def test_each_node_row_names_the_engine_node_ranks_it_runs():
    # glm52: 4 nodes x 8 GPUs, engines of TP 16 over nodes 0-1 and 2-3; router and session beside the driver.
    plan = compile_design(compose(["+recipe=glm52_lora_agentic"]))
    rows = node_lines(plan)
    expected = [
        "engine0 (node rank 0 of 2)",
        "engine0 (node rank 1 of 2)",
        "engine1 (node rank 0 of 2)",
        "engine1 (node rank 1 of 2)",
    ]
    for k, (row, engine) in enumerate(zip(rows, expected, strict=True)):
        assert engine in row and f"address {{node{k}}}" in row, row
        assert all(other not in row for other in expected if other != engine), row
    assert "router, session" in rows[0]
    commands = summarize(plan, "plan.yaml")
    assert "engine 0 rank 1  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 python -m sglang.launch_server" in commands
    assert "--node-rank 1 --dist-init-addr '{node0}:30200'" in commands


def test_an_engine_within_a_node_keeps_its_plain_name():
    plan = compile_design(
        compose(
            [
                "+recipe=tiny_lora_agentic_router",
                "cluster.nodes=2",
                "executor=ray",
                "cluster.cpu_devices_per_node=1",
                "topology.actor_num_gpus_per_node=1",
            ]
        )
    )
    rows = node_lines(plan)
    assert rows[0].startswith("driver (trainer rank 0), engine0, router, session;") and "engine1" in rows[1]
    assert "node rank" not in summarize(plan, "plan.yaml")
