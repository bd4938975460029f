"""Values the plan derives and the user never sets (docs/system.md §1.2 "Adjustments"), read off compiled Plans.

Where a combination is rejected by a rule but the derivation itself is still defined (multi-LoRA colocated on
GPUs), `derive` is called on the composed config directly.
"""

import pytest

from miles_runner.config.compose import compose
from miles_runner.core.adapters import min_groups_per_dp_split
from miles_runner.core.targets import MLA_KV, MLA_Q, STANDARD_LINEAR
from miles_runner.plan.derive import derive

TINY = ("+recipe=tiny_lora_agentic",)  # cpu, colocated, session v1, in_place, tiny MoE
TINY_MULTI = ("+recipe=tiny_multi_lora",)
QWEN05 = ("+recipe=qwen25_05b_lora",)  # one GPU, colocated, dense, all-linear
QWEN30 = ("+recipe=qwen3_30b_a3b_r3_session",)  # 8 GPUs, colocated, session v1, in_place, R3, router
GLM = ("+recipe=glm52_lora_agentic",)  # MLA with q_lora_rank, retract
MATH = ("+recipe=multi_lora_math",)  # multi-LoRA on GPUs, disaggregated
R3_ON = (*TINY, "rollout.routing_replay=true")
ALL_LINEAR = "adapters.target_modules=[all-linear]"
# all-linear on glm52 targets its experts: Megatron-Bridge exports expert LoRA only with EP 1
# (bridge-expert-lora-needs-ep1).
GLM_ALL_LINEAR = (*GLM, ALL_LINEAR, "trainer.parallel.ep=1")
SLOTS = ["__miles_slot_0", "__miles_slot_1", "__miles_slot_2", "__miles_slot_3"]


def engine_argv(plan) -> list[str]:
    return plan.engines[0].launch.argv


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values after `flag`, up to the next `--` flag."""
    start = argv.index(flag) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


# ---- use_addition_r3: session on + in_place + routing replay, nothing less ----


def test_addition_r3_on_with_session_in_place_and_routing_replay(plan):
    p = plan(R3_ON)
    assert p.capabilities.use_addition_r3
    assert p.session.use_addition_r3
    assert "--addition-r3" in p.session.launch.argv


@pytest.mark.parametrize(
    "missing",
    ["session=off", "pause_generation_mode=retract", "rollout.routing_replay=false"],
    ids=["no-session", "retract", "no-routing-replay"],
)
def test_addition_r3_off_without_each_condition(missing, plan):
    assert not plan([*R3_ON, missing]).capabilities.use_addition_r3


def test_addition_r3_session_flag_absent_when_off(plan):
    p = plan([*R3_ON, "pause_generation_mode=retract"])
    assert not p.session.use_addition_r3
    assert "--addition-r3" not in p.session.launch.argv
    assert "--routed-experts" in p.session.launch.argv  # plain R3 still returns the routing


@pytest.mark.parametrize(("recipe", "expected"), [(QWEN30, True), (GLM, False)], ids=["qwen3-in-place", "glm-retract"])
def test_addition_r3_in_recipes(recipe, expected, plan):
    assert plan(recipe).capabilities.use_addition_r3 is expected


# ---- offload: colocated roles on GPUs take turns, so both offload ----
# The qwen25 recipe sets both false: null hands the choice back to the derivation.
DERIVED_OFFLOAD = ("topology.offload_train=null", "topology.offload_rollout=null")


def test_colocated_gpu_cluster_turns_offload_on(plan):
    p = plan([*QWEN05, *DERIVED_OFFLOAD])
    assert (p.capabilities.offload_train, p.capabilities.offload_rollout) == (True, True)
    assert p.trainer.offload_train
    assert "--enable-memory-saver" in engine_argv(p)


def test_cpu_only_cluster_keeps_offload_off(plan):
    p = plan(TINY)
    assert (p.capabilities.offload_train, p.capabilities.offload_rollout) == (False, False)


def test_disaggregated_gpu_cluster_keeps_offload_off(plan):
    disaggregated = ("cluster=h200_4x8", "topology=disaggregated", "topology.actor_num_nodes=1")
    p = plan([*QWEN30, *disaggregated, "engine.build=miles_fork"])  # its broadcast sync needs the fork
    assert (p.capabilities.offload_train, p.capabilities.offload_rollout) == (False, False)
    assert "--enable-memory-saver" not in engine_argv(p)


def test_multi_lora_never_defaults_offload_on():
    d = derive(compose([*MATH, "topology=colocated"]).config)  # rejected by a rule; the default is still defined
    assert (d.offload_train, d.offload_rollout) == (False, False)


def test_explicit_offload_setting_is_kept(plan):
    p = plan([*QWEN05, *DERIVED_OFFLOAD, "topology.offload_train=false"])
    assert (p.capabilities.offload_train, p.capabilities.offload_rollout) == (False, True)


def test_the_qwen25_recipe_keeps_its_trainer_resident(plan):
    p = plan(QWEN05)
    assert (p.capabilities.offload_train, p.capabilities.offload_rollout) == (False, False)
    assert not p.trainer.offload_train and "--enable-memory-saver" not in engine_argv(p)


# ---- adapter names on the engines ----


def test_single_adapter_is_served_as_miles_lora(plan):
    p = plan(TINY)
    assert [a.lora_name for a in p.adapters] == ["miles_lora"]
    assert p.session.lora_name == "miles_lora"
    assert flag_values(engine_argv(p), "--max-loras-per-batch") == ["1"]


def test_multi_lora_adapters_get_slot_names_in_order(plan):
    p = plan(TINY_MULTI)
    assert [(a.name, a.lora_name) for a in p.adapters] == [
        ("count", "__miles_slot_0"),
        ("retry", "__miles_slot_1"),
        ("letters", "__miles_slot_2"),
    ]


def test_multi_lora_engines_hold_every_slot(plan):
    p = plan(TINY_MULTI)  # max_slots 4, three adapters
    assert derive(compose(list(TINY_MULTI)).config).engine_lora_names == SLOTS
    assert flag_values(engine_argv(p), "--max-loras-per-batch") == ["4"]


def test_without_adapters_no_lora_is_served(plan):
    p = plan(["adapters=none", "lora_mode=none"])
    assert p.adapters == []
    assert "--enable-lora" not in engine_argv(p)


def test_train_only_adapter_is_not_loaded_on_engines(plan):
    p = plan(["adapters.train_only=true"])
    assert p.capabilities.lora_enabled and not p.capabilities.lora_rollout_enabled
    assert "--enable-lora" not in engine_argv(p)


# ---- weight-sync method ----


@pytest.mark.parametrize(
    ("overrides", "method"),
    [
        (TINY, "tensor"),
        (QWEN30, "tensor"),
        (TINY_MULTI, "broadcast"),
        (MATH, "broadcast"),
        (
            [
                "adapters=none",
                "lora_mode=none",
                "topology=disaggregated",
                "topology.actor_num_gpus_per_node=1",
                "weight_sync.transfer_mode=p2p",
            ],
            "p2p",
        ),
    ],
    ids=["cpu-colocated", "gpu-colocated", "cpu-disaggregated", "gpu-disaggregated", "full-weights-p2p"],
)
def test_weight_sync_transfer_mode_follows_topology(overrides, method, plan):
    assert plan(overrides).weight_sync.transfer_mode == method


def test_colocated_sync_ignores_the_transfer_mode():
    cfg = compose([*TINY, "weight_sync.transfer_mode=p2p"]).config  # rejected by rules; the method is still tensor
    assert derive(cfg).transfer_mode == "tensor"


# ---- router policy ----


@pytest.mark.parametrize(
    ("overrides", "policy"),
    [
        (QWEN30, "manual"),
        ([*QWEN30, "session=off"], "round_robin"),
        ([*QWEN30, "router.policy=cache_aware"], "cache_aware"),
        ([*QWEN30, "session=off", "router.policy=random"], "random"),
    ],
    ids=["session-auto", "no-session-auto", "session-explicit", "no-session-explicit"],
)
def test_router_policy(overrides, policy, plan):
    p = plan(overrides)
    assert p.router.policy == policy
    assert flag_values(p.router.launch.argv, "--policy") == [policy]


def test_router_lists_every_engine(plan):
    p = plan(QWEN30)  # 8 GPUs, engines of TP 4
    assert flag_values(p.router.launch.argv, "--worker-urls") == [e.launch.url for e in p.engines]
    assert len(p.engines) == 2


# ---- LoRA target modules: all-linear, MLA-aware, with exclusions ----


def test_all_linear_on_a_dense_model_is_the_seven_standard_modules(plan):
    p = plan(QWEN05)
    assert p.adapters[0].target_modules == list(STANDARD_LINEAR)
    assert STANDARD_LINEAR == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_all_linear_on_glm_adds_the_mla_projections(plan):
    p = plan(GLM_ALL_LINEAR)
    targets = p.adapters[0].target_modules
    assert targets == [*STANDARD_LINEAR, "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"]
    assert flag_values(engine_argv(p), "--lora-target-modules") == targets


def test_all_linear_never_targets_the_dsa_indexer(plan):
    assert not {"wq_b", "wk", "weights_proj"} & set(plan(GLM_ALL_LINEAR).adapters[0].target_modules)


def test_mla_without_q_lora_adds_only_the_kv_projections(plan):
    targets = plan([*GLM_ALL_LINEAR, "model.q_lora_rank=0"]).adapters[0].target_modules
    assert targets == [*STANDARD_LINEAR, *MLA_KV]


def test_q_lora_rank_alone_is_not_mla(plan):
    targets = plan([*QWEN05, "model.q_lora_rank=1536"]).adapters[0].target_modules
    assert not set(MLA_Q) & set(targets)


def test_exclude_modules_removes_expanded_names(plan):
    # gate_proj and up_proj go together: Megatron fuses them into one linear (megatron-lora-fused-targets).
    p = plan([*GLM_ALL_LINEAR, "adapters.exclude_modules=[q_proj,kv_b_proj,gate_proj,up_proj]"])
    assert p.adapters[0].target_modules == [
        "k_proj",
        "v_proj",
        "o_proj",
        "down_proj",
        "kv_a_proj_with_mqa",
        "q_a_proj",
        "q_b_proj",
    ]


def test_exclude_of_an_untargeted_module_changes_nothing(plan):
    assert plan([*QWEN05, "adapters.exclude_modules=[q_a_proj]"]).adapters[0].target_modules == list(STANDARD_LINEAR)


def test_explicit_targets_are_kept_in_order_without_duplicates(plan):
    p = plan(["adapters.target_modules=[o_proj,q_proj,all-linear]"])
    assert p.adapters[0].target_modules == ["o_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def test_multi_lora_adapter_inherits_expanded_targets(plan):
    p = plan(MATH)  # all-linear on dense Qwen3-4B
    assert all(a.target_modules == list(STANDARD_LINEAR) for a in p.adapters)


# ---- multi-LoRA batch split (docs/system.md §4.6) ----


@pytest.mark.parametrize(
    ("n", "dp", "groups"),
    [(4, 8, 2), (8, 8, 1), (16, 8, 1), (6, 8, None), (2, 8, 4), (1, 1, 1), (0, 8, None), (4, 0, None)],
)
def test_min_groups_per_dp_split(n, dp, groups):
    assert min_groups_per_dp_split(n, dp) == groups


# ---- other capabilities ----


def test_engines_serve_the_largest_adapter_rank(plan):
    p = plan(MATH)  # adapters.rank 32, runs 16/32/16
    assert flag_values(engine_argv(p), "--max-lora-rank") == ["32"]


def test_explicit_engine_max_lora_rank_is_kept(plan):
    assert flag_values(engine_argv(plan([*MATH, "engine.max_lora_rank=64"])), "--max-lora-rank") == ["64"]


def test_multi_lora_uses_a_dynamic_global_batch(plan):
    assert plan(MATH).capabilities.use_dynamic_global_batch_size
    assert not plan(TINY).capabilities.use_dynamic_global_batch_size


@pytest.mark.parametrize(
    ("overrides", "normalize"),
    [
        (TINY, True),
        ([*TINY, "rollout.n_samples_per_prompt=1"], False),
        ([*TINY_MULTI, "rollout.n_samples_per_prompt=1"], True),
    ],
    ids=["group", "one-sample", "one-sample-multi-lora"],
)
def test_std_normalisation_needs_groups_except_under_multi_lora(overrides, normalize, plan):
    assert plan(overrides).capabilities.normalize_advantages_by_std is normalize


def test_routing_replay_asks_engines_for_routed_experts(plan):
    assert "--enable-return-routed-experts" in engine_argv(plan(R3_ON))
    assert "--enable-return-routed-experts" not in engine_argv(plan(TINY))
