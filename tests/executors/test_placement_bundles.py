"""What the Ray executor reserves for a plan, per role and per node (no Ray needed: the bundles are data)."""

from miles_runner.config.compose import compose
from miles_runner.executors.ray import placement_bundles
from miles_runner.plan.compile import compile_design, compile_plan


def test_colocated_trainer_and_engines_share_one_bundle_per_device_pinned_to_its_node():
    plan = compile_plan(
        compose(
            ["+recipe=tiny_lora_agentic_router", "cluster.nodes=2", "executor=ray", "cluster.cpu_devices_per_node=2"]
        )
    )
    assert placement_bundles(plan) == {
        "trainer+engines": [
            {"CPU": 1, "miles_node_0": 1},
            {"CPU": 1, "miles_node_0": 1},
            {"CPU": 1, "miles_node_1": 1},
            {"CPU": 1, "miles_node_1": 1},
        ],
    }


def test_disaggregated_roles_get_their_own_bundles_on_the_nodes_the_plan_gives_them():
    # The trainer on node 0 (8 GPUs), the engines on the other three nodes: GPU bundles, one per device.
    plan = compile_design(
        compose(
            [
                "+recipe=qwen3_30b_a3b_r3_session",
                "cluster=h200_4x8",
                "topology=disaggregated",
                "topology.actor_num_nodes=1",
                "engine.build=miles_fork",
            ]
        )
    )
    bundles = placement_bundles(plan)
    assert set(bundles) == {"trainer", "engines"}
    assert bundles["trainer"] == [{"GPU": 1, "miles_node_0": 1}] * 8
    assert bundles["engines"] == [{"GPU": 1, f"miles_node_{node}": 1} for node in (1, 2, 3) for _ in range(8)]


def test_an_engine_wider_than_a_node_reserves_its_devices_on_every_node_it_spans():
    # The trainer on nodes 0-1, one engine of TP 16 over nodes 2 and 3 (node rank 0 and 1).
    plan = compile_design(
        compose(
            [
                "+recipe=qwen3_30b_a3b_r3_session",
                "cluster=h200_4x8",
                "topology=disaggregated",
                "topology.actor_num_nodes=2",
                "engine.tp_size=16",
                "engine.build=miles_fork",
            ]
        )
    )
    [engine] = plan.engines
    assert (engine.nodes, [r.node for r in engine.node_ranks]) == ([2, 3], [3])
    assert placement_bundles(plan)["engines"] == [
        {"GPU": 1, f"miles_node_{node}": 1} for node in (2, 3) for _ in range(8)
    ]
