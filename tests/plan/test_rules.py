"""Every plan rule has a config it rejects and a near-identical config it accepts, driven through Hydra.

Each RuleCase composes `base + bad` (must raise a PlanError naming the rule) and `base + good` (must not name
it; in this table every good config compiles to a Plan). The rejecting case's own `fix:` line, pasted onto
the command line, must then clear that rule. A rule added to RULES without a case here fails
test_every_rule_has_a_case.
"""

from dataclasses import dataclass

import pytest

from miles_runner.core.errors import PlanError, Problem
from miles_runner.plan.rules import NOT_BUILT, PRECONDITIONS, RULES


@dataclass(frozen=True)
class RuleCase:
    rule_id: str
    base_overrides: tuple[str, ...]
    bad_overrides: tuple[str, ...]
    good_overrides: tuple[str, ...]
    variant: str = ""  # tells apart several cases of one rule

    @property
    def case_id(self) -> str:
        return f"{self.rule_id}/{self.variant}" if self.variant else self.rule_id

    @property
    def bad(self) -> list[str]:
        return [*self.base_overrides, *self.bad_overrides]

    @property
    def good(self) -> list[str]:
        return [*self.base_overrides, *self.good_overrides]


# Bases: recipes, and small CPU shapes built on the default config (cpu cluster of 2 devices, tiny MoE, fsdp+peft).
CPU: tuple[str, ...] = ()
# Fixed ports (the defaults are chosen at start, "auto", and never clash): SGLang's and the router's usual ones.
FIXED = ("engine.base_port=30010", "session.port=30001", "router.port=30000", "router.metrics_port=30090")
TINY = ("+recipe=tiny_lora_agentic",)  # session v1, in_place, colocated, one adapter
TINY_MULTI = ("+recipe=tiny_multi_lora",)  # three adapters, disaggregated 1 + 1 slot
QWEN05 = ("+recipe=qwen25_05b_lora",)  # megatron + bridge, one GPU, sglang
QWEN30 = ("+recipe=qwen3_30b_a3b_r3_session",)  # 8 GPUs colocated, TP 2, EP 8, engines TP 4
GLM = ("+recipe=glm52_lora_agentic",)  # 4 x 8 H200, ray
# Two CPU nodes of one device each (ray), colocated: one embedded engine of TP 1 per node.
TWO_CPU_NODES = (
    *TINY,
    "executor=ray",
    "cluster.nodes=2",
    "cluster.cpu_devices_per_node=1",
    "topology.actor_num_gpus_per_node=1",
)
MATH = ("+recipe=multi_lora_math",)  # megatron multi-LoRA, 4 train + 4 rollout GPUs, TP 2 (DP 2)
FULL_WEIGHTS = ("adapters=none", "lora_mode=none")
CPU_DISAGG = ("topology=disaggregated", "topology.actor_num_gpus_per_node=1")  # 1 trainer + 1 engine device
ASYNC = (*CPU_DISAGG, "rollout.schedule=async", "rollout.max_weight_staleness=1", "algorithm.use_tis=true")
FULLY_ASYNC = (*ASYNC, "rollout.fully_async=true")
MULTI_ASYNC = (*TINY_MULTI, "rollout.schedule=async", "algorithm.use_tis=true")
RAW = ("lora_mode=raw",)  # the project's own LoRA on megatron-core (qwen2, qwen3, qwen3_moe)
MEGATRON_CPU = ("trainer=megatron", *RAW)  # the Megatron trainer on the default CPU shape (tiny MoE, 2 devices)
# Disaggregated LoRA sync broadcasts the adapter: a route only the sglang-miles fork serves.
QWEN30_DISAGG = (
    *QWEN30,
    "cluster=h200_4x8",
    "topology=disaggregated",
    "topology.actor_num_nodes=1",
    "engine.build=miles_fork",
)
# A trainer on part of node 0, so that the engines start mid-node (8-GPU nodes).
HALF_NODE_TRAINER = (
    *QWEN30_DISAGG,
    "topology.actor_num_gpus_per_node=4",
    "trainer.parallel.ep=4",
    "topology.rollout_num_gpus=24",
)
TWO_DEVICE_TRAINER = (
    *QWEN30_DISAGG,
    "topology.actor_num_gpus_per_node=2",
    "trainer.parallel.ep=2",
    "topology.rollout_num_gpus=8",
)  # engines of TP 4: 4 devices of node 0, then 2 + 2
INTERVAL, STALE = "weight_sync.update_weights_interval", "rollout.max_weight_staleness"
ESTIMATOR = "algorithm.advantage_estimator"
# tiny_multi_lora's adapters, the first one replaced (a whole-list override: its items set only a few keys).
TINY_RUNS = "adapters.runs=[{first}, {{name: reverse, task: reverse}}, {{name: count, task: count}}]"

# fmt: off
CASES = [
    # ---- preconditions (checked alone, before the rules that divide by these sizes) ----
    RuleCase("sizes-positive", CPU, ("trainer.parallel.tp=0",), ("trainer.parallel.tp=1",)),
    RuleCase("sizes-positive", CPU, ("cluster.cpu_devices_per_node=0",), ("cluster.cpu_devices_per_node=1",),
             "cpu-devices"),
    RuleCase("sizes-positive", CPU, ("executor.engine_restarts=-1",), ("executor.engine_restarts=2",), "restarts"),
    # ---- session server and pause mode ----
    RuleCase(
        "session-needs-resumable-pause", TINY, ("pause_generation_mode=abort",), ("pause_generation_mode=in_place",)
    ),
    RuleCase(
        "session-needs-resumable-pause", TINY,
        ("session=v2", "pause_generation_mode=abort"), ("session=v2", "pause_generation_mode=retract"), "v2",
    ),
    RuleCase(
        "session-v2-returns-sample-lists", TINY,
        ("session=v2", "rollout.partial_rollout=true"), ("session=v1", "rollout.partial_rollout=true"),
    ),
    RuleCase(
        "session-v2-returns-sample-lists", TINY,
        ("session=v2", "rollout.group_rm=true"), ("session=v2", "rollout.group_rm=false"), "group-rm",
    ),
    RuleCase("session-limits-fit-rollout", TINY, ("session.max_sessions=100",), ("session.max_sessions=128",)),
    RuleCase("session-open-to-the-network-needs-key", TINY, ("session.host=0.0.0.0",),
             ("session.host=0.0.0.0", "security.api_key_env=MILES_RUN_KEY")),
    RuleCase("session-limits-fit-rollout", CPU, ("session.max_age_s=0",), ("session.max_age_s=1",), variant="age"),
    RuleCase(
        "tito-model-needs-session", CPU,
        ("session.tito_model=qwen3",), ("session.tito_model=qwen3", "session=v1"),
    ),
    RuleCase(
        "session-needs-adapter-on-engines", TINY,
        ("adapters.train_only=true",), ("adapters.train_only=true", "session=off"),
    ),
    # ---- fully-async and the drivers ----
    RuleCase("fully-async-needs-disaggregated", FULLY_ASYNC, ("topology=colocated",), ("topology=disaggregated",)),
    RuleCase(
        "fully-async-needs-resumable-pause", FULLY_ASYNC,
        ("pause_generation_mode=abort",), ("pause_generation_mode=retract",),
    ),
    RuleCase("fully-async-single-adapter", MULTI_ASYNC, ("rollout.fully_async=true",), ("rollout.fully_async=false",)),
    RuleCase(
        "fully-async-no-partial-rollout", FULLY_ASYNC,
        ("rollout.partial_rollout=true",), ("rollout.partial_rollout=false",),
    ),
    RuleCase(
        "fully-async-needs-async-driver", (*CPU_DISAGG, "rollout.fully_async=true"),
        ("rollout.schedule=sync",),
        ("rollout.schedule=async", "rollout.max_weight_staleness=1", "algorithm.use_tis=true"),
    ),
    RuleCase("async-driver-needs-disaggregated", ASYNC, ("topology=colocated",), ("topology=disaggregated",)),
    RuleCase(
        "async-needs-off-policy-correction", ASYNC,
        ("algorithm.use_tis=false",), ("algorithm.use_tis=false", "trainer.keep_old_actor=true"),
    ),
    RuleCase(
        "async-driver-is-one-step-stale", ASYNC,
        ("rollout.max_weight_staleness=0",), ("rollout.max_weight_staleness=1",),
    ),
    # ---- the adapter push cadence and the checks of each push ----
    RuleCase("update-interval-positive", CPU, (f"{INTERVAL}=0",), (f"{INTERVAL}=1",)),
    RuleCase(
        "update-interval-within-staleness", CPU,
        (f"{INTERVAL}=3", "algorithm.use_tis=true"), (f"{INTERVAL}=3", "algorithm.use_tis=true", f"{STALE}=2"),
    ),
    RuleCase(
        "update-interval-within-staleness", ASYNC, (f"{INTERVAL}=2",), (f"{INTERVAL}=2", f"{STALE}=2"), "async"
    ),
    RuleCase(
        "update-interval-needs-off-policy-correction", CPU,
        (f"{INTERVAL}=2", f"{STALE}=1"), (f"{INTERVAL}=2", f"{STALE}=1", "algorithm.use_tis=true"),
    ),
    RuleCase(
        "multi-lora-pushes-every-step", TINY_MULTI, (f"{INTERVAL}=2", "algorithm.use_tis=true"), (f"{INTERVAL}=1",)
    ),
    RuleCase(
        "max-logprob-gap-positive", CPU, ("weight_sync.max_logprob_gap=0",), ("weight_sync.max_logprob_gap=0.05",)
    ),
    RuleCase(
        "check-weight-equal-cannot-read-adapters", CPU,
        ("weight_sync.check_weight_equal=true",), ("weight_sync.check_weight_equal=false",),
    ),
    # ---- offload and optimizer storage ----
    RuleCase("disk-offload-needs-megatron", CPU, ("trainer.offload_target=disk",), ("trainer.offload_target=cpu",)),
    RuleCase(
        "disk-offload-needs-megatron", (*MEGATRON_CPU, "topology.offload_train=true", "trainer.offload_target=disk"),
        ("trainer.offload_disk_chunk_mb=0",), ("trainer.offload_disk_chunk_mb=64",), "chunk-mb",
    ),
    RuleCase(
        "disk-offload-needs-megatron", GLM,
        ("topology.offload_train=false",), ("topology.offload_train=true",), "offload-off",
    ),
    RuleCase(
        "streamed-optimizer-state-rejects-lora", CPU,
        ("trainer.stream_optimizer_state_to_disk=true",),
        ("trainer.stream_optimizer_state_to_disk=true", *FULL_WEIGHTS),
    ),
    RuleCase(
        "rematerialize-rejects-lora", CPU,
        ("trainer.rematerialize_param_from_master_weight=true",),
        ("trainer.rematerialize_param_from_master_weight=true", *FULL_WEIGHTS),
    ),
    RuleCase("optimizer-cpu-offload-needs-megatron", CPU, ("optimizer.cpu_offload=true",),
             ("optimizer.cpu_offload=false",)),
    # ---- weight transfer ----
    RuleCase(
        "lora-sync-needs-broadcast", CPU_DISAGG,
        ("weight_sync.transfer_mode=p2p",), ("weight_sync.transfer_mode=p2p", *FULL_WEIGHTS),
    ),
    RuleCase(
        "lora-sync-needs-broadcast", CPU_DISAGG,
        ("weight_sync.transfer_mode=disk-delta",), ("weight_sync.transfer_mode=broadcast",), "disk-delta",
    ),
    RuleCase(
        "transfer-mode-needs-disaggregated", FULL_WEIGHTS,
        ("weight_sync.transfer_mode=p2p",), ("weight_sync.transfer_mode=p2p", *CPU_DISAGG),
    ),
    # ---- LoRA modes and targets ----
    RuleCase("lora-mode-needs-adapters", CPU, ("adapters=none",), FULL_WEIGHTS),
    RuleCase("adapters-need-lora-mode", CPU, ("lora_mode=none",), ("lora_mode=peft",)),
    RuleCase("adapters-need-lora-mode", QWEN05, ("lora_mode=none",), ("lora_mode=bridge",), "megatron"),
    RuleCase("lora-mode-matches-trainer", CPU, ("lora_mode=bridge",), ("lora_mode=peft",)),
    RuleCase("lora-mode-matches-trainer", QWEN05, ("lora_mode=peft",), ("lora_mode=bridge",), "megatron"),
    RuleCase(
        "disaggregated-lora-needs-bridge", (*QWEN05, "cluster=h100_1x8", "topology.actor_num_gpus_per_node=4"),
        ("topology=disaggregated", *RAW), ("topology=colocated", *RAW),
    ),
    RuleCase(
        "disaggregated-lora-needs-pp1", (*QWEN05, "cluster=h100_1x8", "topology.actor_num_gpus_per_node=4"),
        ("topology=disaggregated", "trainer.parallel.pp=2"), ("topology=colocated", "trainer.parallel.pp=2"),
    ),
    RuleCase(
        "ppo-critic-rejects-bridge", QWEN05,
        ("algorithm.advantage_estimator=ppo",), ("algorithm.advantage_estimator=grpo",),
    ),
    RuleCase("lora-rank-positive", CPU, ("adapters.rank=0",), ("adapters.rank=16",)),
    RuleCase("lora-rank-positive", CPU, ("adapters.alpha=0",), ("adapters.alpha=32",), "alpha"),
    RuleCase("lora-targets-required", CPU, ("adapters.target_modules=[]",), ("adapters.target_modules=[all-linear]",)),
    RuleCase(
        "lora-targets-required", CPU,
        ("adapters.exclude_modules=[q_proj,k_proj,v_proj,o_proj]",), ("adapters.exclude_modules=[o_proj]",),
        "all-excluded",
    ),
    RuleCase("lora-target-unknown", CPU, ("adapters.target_modules=[q_prj]",), ("adapters.target_modules=[q_proj]",)),
    # ---- multi-LoRA ----
    RuleCase("multi-lora-needs-disaggregated", TINY_MULTI, ("topology=colocated",), ("topology=disaggregated",)),
    RuleCase("multi-lora-needs-slotted-lora", MATH, ("lora_mode=none",), ("lora_mode=bridge",)),
    RuleCase("multi-lora-needs-slotted-lora", TINY_MULTI, ("lora_mode=none",), ("lora_mode=peft",), "fsdp"),
    RuleCase("multi-lora-needs-pp1", MATH, ("trainer.parallel.pp=2",), ("trainer.parallel.pp=1",)),
    RuleCase("multi-lora-needs-adam", MATH, ("optimizer.name=muon",), ("optimizer.name=adam",)),
    RuleCase(
        "multi-lora-needs-thd", MATH, ("trainer.parallel.qkv_format=bshd",), ("trainer.parallel.qkv_format=thd",)
    ),
    RuleCase(
        "multi-lora-keeps-gradients-resident", TINY_MULTI,
        ("topology.offload_train=true",), ("topology.offload_train=false",),
    ),
    RuleCase(
        "multi-lora-no-shared-outer-experts", TINY_MULTI,
        ("adapters.experts_shared_outer=true",), ("adapters.experts_shared_outer=false",),
    ),
    RuleCase(
        "multi-lora-per-adapter-loss", TINY_MULTI,
        ("trainer.calculate_per_token_loss=true",), ("trainer.calculate_per_token_loss=false",),
    ),
    RuleCase(
        "multi-lora-needs-adapters", TINY_MULTI,
        ("adapters.runs=[]",), ("adapters.runs=[]", "adapters.service_mode=true"),
    ),
    RuleCase(
        "multi-lora-needs-adapters", TINY_MULTI, ("adapters.max_slots=2",), ("adapters.max_slots=3",), "slots"
    ),
    RuleCase(
        "adapter-names-unique-and-safe", TINY_MULTI,
        ("adapters.runs.0.name=../arith",), ("adapters.runs.0.name=arith-2",), "path",
    ),
    RuleCase(
        "adapter-names-unique-and-safe", TINY_MULTI,
        ("adapters.runs.1.name=letters",), ("adapters.runs.1.name=letters_b",), "duplicate",
    ),
    RuleCase(
        "adapter-names-unique-and-safe", TINY_MULTI,
        ("adapters.runs.2.name=__miles_slot_0",), ("adapters.runs.2.name=miles_slot_0",), "reserved",
    ),
    RuleCase(
        "adapter-fits-engine", (*MATH, "engine.max_lora_rank=16"),
        ("adapters.runs.1.rank=32",), ("adapters.runs.1.rank=16",), "rank",
    ),
    RuleCase(
        "adapter-fits-engine", TINY_MULTI,
        (TINY_RUNS.format(first="{name: arith, target_modules: [gate_proj]}"),),
        (TINY_RUNS.format(first="{name: arith, target_modules: [q_proj]}"),),
        "targets",
    ),
    RuleCase(
        "adapter-batch-shape", TINY_MULTI,
        (TINY_RUNS.format(first="{name: arith, rollout_batch_size: 64}"),),  # 64 x 8 > 4 x (8 x 8)
        (TINY_RUNS.format(first="{name: arith, rollout_batch_size: 16}"),),
        "cap",
    ),
    RuleCase(
        "adapter-batch-shape", MATH,
        ("adapters.runs.0.n_samples_per_prompt=3",), ("adapters.runs.0.n_samples_per_prompt=2",), "dp-split",
    ),
    RuleCase(
        "adapter-batch-shape", (*MATH, "trainer.parallel.tp=1"),  # DP 4: n=2 takes whole pairs of groups
        ("adapters.runs.1.n_samples_per_prompt=2", "adapters.runs.1.rollout_batch_size=7"),
        ("adapters.runs.1.n_samples_per_prompt=2", "adapters.runs.1.rollout_batch_size=8"),
        "group-multiple",
    ),
    # ---- the Megatron trainer: LoRA paths by model family, fused targets, layouts; what it has not built ----
    RuleCase("raw-lora-needs-converter", GLM, RAW, ("lora_mode=bridge",)),  # glm5: Megatron-Bridge builds it
    RuleCase("raw-lora-needs-converter", (*QWEN05, *RAW), ("model.family=phi3",), ("model.family=qwen2",),
             "no-bridge"),
    RuleCase("native-lora-model-not-supported", QWEN05, ("model.native_lora=true",), ("model.native_lora=false",)),
    RuleCase("native-lora-model-not-supported", MEGATRON_CPU, ("model.native_lora=true",),
             ("model.native_lora=false",), "raw"),
    RuleCase("megatron-lora-fused-targets", QWEN05, ("adapters.target_modules=[q_proj,v_proj]",),
             ("adapters.target_modules=[q_proj,k_proj,v_proj]",)),
    RuleCase("megatron-lora-fused-targets", MEGATRON_CPU, ("adapters.target_modules=[up_proj,down_proj]",),
             ("adapters.target_modules=[gate_proj,up_proj,down_proj]",), "gate-up"),
    RuleCase("megatron-lora-fused-targets", QWEN05, ("adapters.exclude_modules=[k_proj]",),
             ("adapters.exclude_modules=[q_proj,k_proj,v_proj]",), "excluded"),  # all-linear less k_proj
    # MLA attention has no fused linear_qkv: its projections take a LoRA each; gate/up stay fused.
    RuleCase("megatron-lora-fused-targets", GLM, ("adapters.target_modules=[q_a_proj,kv_b_proj,gate_proj]",),
             ("adapters.target_modules=[q_a_proj,kv_b_proj]",), "mla"),
    RuleCase("bridge-supports-model", QWEN05, ("model.family=phi3",), ("model.family=qwen2",)),
    RuleCase("bridge-expert-lora-needs-ep1", QWEN30, ("adapters.target_modules=[all-linear]",),
             ("adapters.target_modules=[all-linear]", "trainer.parallel.ep=1")),
    RuleCase("bridge-expert-lora-needs-ep1", QWEN30, ("adapters.target_modules=[all-linear]",),
             ("adapters.target_modules=[all-linear]", *RAW), "raw"),  # raw LoRA exports every expert under EP
    RuleCase("megatron-lora-layout-not-built", QWEN05, ("adapters.lora_type=canonical_lora",),
             ("adapters.lora_type=lora",)),
    RuleCase("megatron-lora-layout-not-built", MEGATRON_CPU, ("adapters.experts_shared_outer=true",),
             ("adapters.experts_shared_outer=false",), "shared-outer"),
    RuleCase("bridge-multi-lora-needs-converter", MATH, ("model=glm52_744b_a40b",), ("model=qwen3_4b",)),
    RuleCase("megatron-parallelism-not-built", MEGATRON_CPU, ("trainer.parallel.pp=2",), ("trainer.parallel.pp=1",)),
    RuleCase("megatron-parallelism-not-built", MEGATRON_CPU, ("trainer.parallel.cp=2",), ("trainer.parallel.cp=1",),
             "cp"),
    RuleCase("megatron-parallelism-not-built", MEGATRON_CPU, ("trainer.parallel.etp=2",),
             ("trainer.parallel.etp=1", "trainer.parallel.tp=2"), "etp"),  # TP is built (with SP)
    RuleCase("tensor-parallel-divides-heads", (*QWEN05, "cluster=h100_1x8", "topology.actor_num_gpus_per_node=4"),
             ("trainer.parallel.tp=4",), ("trainer.parallel.tp=2",)),  # 14 heads
    RuleCase("tensor-parallel-divides-heads", (*MEGATRON_CPU, "topology.actor_num_gpus_per_node=4",
                                               "cluster.cpu_devices_per_node=8"),
             ("trainer.parallel.tp=4",), ("trainer.parallel.tp=2",), "kv-heads"),  # 4 heads, 2 KV heads (config.json)
    RuleCase("bridge-cannot-start-from-adapter", (*MEGATRON_CPU, "lora_mode=bridge"), ("adapters.path=/no/such",),
             ("lora_mode=raw", "adapters.path=''")),
    RuleCase("lora-target-not-in-model", GLM, ("adapters.target_modules=[q_proj,k_proj,v_proj,o_proj]",),
             ("adapters.target_modules=[q_a_proj,kv_b_proj,o_proj]",)),
    RuleCase("lora-target-not-in-model", CPU, ("adapters.target_modules=[kv_b_proj,o_proj]",),
             ("adapters.target_modules=[o_proj]",), "standard"),
    RuleCase("embedded-engine-dsa-sparse-topk-not-built",
             ("model=tiny_glm5", "adapters.target_modules=[q_a_proj,o_proj]"),  # index_topk 2048
             ("model.max_context_len=4096",), ("model.max_context_len=2048",)),
    RuleCase("megatron-cpu-dsa-tensor-parallel-not-built",
             (*MEGATRON_CPU, "lora_mode=bridge", "model=tiny_glm5", "trainer.python=.venv-bridge/bin/python",
              "adapters.target_modules=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj]"),
             ("trainer.parallel.tp=2",), ("trainer.parallel.tp=1",)),
    RuleCase("trainer-python-runs-bridge", (*MEGATRON_CPU, "lora_mode=bridge"), (),
             ("trainer.python=.venv-bridge/bin/python",)),  # `make test` builds it first
    RuleCase("trainer-python-runs-bridge", MEGATRON_CPU, ("trainer.python=/no/such/python",), (), "missing"),
    RuleCase("hosted-trainer-multi-node-not-built", TWO_CPU_NODES, ("trainer.python=python3",), ()),
    RuleCase("optimizer-cpu-offload-needs-adam-or-sgd", (*MEGATRON_CPU, "optimizer.cpu_offload=true"),
             ("optimizer.name=muon",), ("optimizer.name=adam",)),
    # ---- plug-ins ----
    RuleCase("plugins-registered", TINY, ("rollout.task=terminal_bench",), ("rollout.task=count",)),
    RuleCase("plugins-registered", TINY, ("rollout.agent=tool_agent",), ("rollout.agent=feedback_loop",), "agent"),
    RuleCase(
        "plugins-registered", TINY_MULTI, ("++adapters.runs.0.reward=deepscaler",),
        ("++adapters.runs.0.reward=exact_match",), "adapter-reward",
    ),
    RuleCase("dataset-task-needs-data", TINY, ("rollout.task=jsonl",),
             ("rollout.task=jsonl", "rollout.data=/data/prompts.jsonl")),
    RuleCase(
        "dataset-task-needs-data", TINY_MULTI, ("++adapters.runs.0.task=jsonl",),
        ("++adapters.runs.0.task=jsonl", "++adapters.runs.0.data=/data/p.jsonl"), "adapter",
    ),
    RuleCase(
        "dataset-task-needs-data", TINY_MULTI, ("++adapters.runs.2.data=bundled:letter.jsonl",),
        ("++adapters.runs.2.data=bundled:letters.jsonl",), "bundled",
    ),
    # ---- routing replay ----
    RuleCase(
        "routing-replay-needs-moe", ("rollout.routing_replay=true",), ("model=tiny_dense",), ("model=tiny_moe",)
    ),
    RuleCase(
        "indexer-replay-needs-dsa", (*GLM, "rollout.indexer_replay=true"),
        ("model.has_dsa_indexer=false",), ("model.has_dsa_indexer=true",),
    ),
    RuleCase(
        "indexer-replay-needs-dsa", (*GLM, "rollout.indexer_replay=true"),
        ("trainer.parallel.cp=2",), ("trainer.parallel.cp=1",), "context-parallel",
    ),
    # ---- cluster and arithmetic ----
    RuleCase("cpu-cluster-runs-no-gpu-components", CPU, ("engine=sglang",), ("engine=embedded",)),
    RuleCase(
        "gpu-cluster-needs-gpus", CPU,
        ("cluster.cpu_only=false",), ("cluster.cpu_only=false", "cluster.gpus_per_node=8"),
    ),
    RuleCase("embedded-engine-model-too-large", CPU, ("model=qwen3_4b",), ("model=qwen25_05b",)),
    RuleCase("embedded-engine-is-one-process", CPU, ("engine.tp_size=2",), ("engine.tp_size=1",)),
    RuleCase("embedded-engine-is-one-process", CPU, ("engine.ep_size=2",), ("engine.ep_size=1",), "ep"),
    RuleCase("fsdp-has-no-model-parallelism", CPU, ("trainer.parallel.tp=2",), ("trainer.parallel.tp=1",)),
    RuleCase(
        "fsdp-has-no-model-parallelism", CPU,
        ("trainer.parallel.ep=2",),
        ("trainer.parallel.ep=2", "trainer=megatron", "lora_mode=bridge", "cluster=h100_1x8",
         "topology.actor_num_gpus_per_node=2"),
        "ep",
    ),
    RuleCase("trainer-fits-cluster", CPU, ("topology.actor_num_nodes=2",), ("topology.actor_num_nodes=1",)),
    RuleCase(
        "trainer-fits-cluster", CPU,
        ("topology.actor_num_gpus_per_node=4",), ("topology.actor_num_gpus_per_node=2",), "gpus-per-node",
    ),
    RuleCase(
        "world-size-divisible-by-model-parallel", QWEN30, ("trainer.parallel.tp=3",), ("trainer.parallel.tp=4",)
    ),
    RuleCase(
        "world-size-divisible-by-model-parallel", QWEN30,
        ("trainer.parallel.ep=16",), ("trainer.parallel.ep=8",), "expert-parallel",
    ),
    RuleCase(
        "world-size-divisible-by-model-parallel", QWEN30,  # 8 GPUs: PP 3 is the culprit, not TP or EP
        ("trainer.parallel.pp=3",), ("trainer.parallel.pp=2", "trainer.parallel.ep=4"), "pipeline",
    ),
    RuleCase("expert-parallel-divides-experts", QWEN30, ("engine.ep_size=3",), ("engine.ep_size=4",)),
    RuleCase(
        "expert-parallel-divides-experts", (*QWEN05, "cluster=h100_1x8"),
        ("trainer.parallel.ep=2",), ("trainer.parallel.ep=1",), "dense",
    ),
    RuleCase("engines-fit-rollout-gpus", QWEN30, ("engine.tp_size=3",), ("engine.tp_size=8",)),
    # SGLang runs an engine over N nodes as TP / N ranks per node: each node must hold as many of its devices.
    RuleCase(
        "engine-split-evenly-over-nodes", QWEN30_DISAGG,  # 8 trainer GPUs, 24 rollout GPUs over three nodes
        ("engine.tp_size=12",), ("engine.tp_size=8",), "whole-nodes",  # 8 + 4 devices
    ),
    RuleCase(
        "engine-split-evenly-over-nodes", (*QWEN30_DISAGG, "topology.rollout_num_gpus=12"),  # one and a half nodes
        ("engine.tp_size=12",), ("engine.tp_size=4",), "part-node",
    ),
    # Engines that start mid-node: TP 8 runs 4 + 4 devices (accepted), TP 6 would run 4 + 2.
    RuleCase("engine-split-evenly-over-nodes", HALF_NODE_TRAINER, ("engine.tp_size=6",), ("engine.tp_size=8",),
             "mid-node"),
    # glm52's engines of TP 16 run 8 + 8 GPUs (the design plan); on 6 GPUs of each node one would run 6 + 6 + 4.
    RuleCase("engine-split-evenly-over-nodes", GLM, ("topology.actor_num_gpus_per_node=6",),
             ("topology.actor_num_gpus_per_node=8",), "glm52"),
    RuleCase(
        "cluster-holds-plan", TINY_MULTI, ("topology.rollout_num_gpus=2",), ("topology.rollout_num_gpus=1",)
    ),
    RuleCase(
        "cluster-holds-plan", CPU,
        ("topology=disaggregated",), ("topology=disaggregated", "topology.actor_num_gpus_per_node=1"),
        "no-rollout-gpus",
    ),
    RuleCase(
        "cluster-holds-plan", (*CPU_DISAGG, "topology.rollout_num_gpus=1"),
        ("topology.actor_num_gpus_per_node=2",), ("topology.actor_num_gpus_per_node=1",), "trainer-takes-all",
    ),
    RuleCase("engine-model-fits-memory", GLM, ("engine.tp_size=4",), ("engine.tp_size=8",)),
    RuleCase("local-executor-is-one-node", GLM, ("executor=local",), ("executor=ray",)),
    RuleCase(
        "batch-arithmetic", CPU, ("rollout.rollout_batch_size=0",), ("rollout.rollout_batch_size=1",), "rollout-size"
    ),
    RuleCase("batch-arithmetic", CPU, ("algorithm.num_steps=0",), ("algorithm.num_steps=1",), "num-steps"),
    RuleCase(
        "batch-arithmetic", CPU,
        ("rollout.max_weight_staleness=-1",), ("rollout.max_weight_staleness=0",), "staleness",
    ),
    RuleCase(
        "batch-arithmetic", CPU, ("algorithm.global_batch_size=3",), ("algorithm.global_batch_size=4",), "dp-split"
    ),
    RuleCase(
        "batch-arithmetic", CPU,
        ("algorithm.global_batch_size=64",), ("algorithm.global_batch_size=32",), "whole-batches",
    ),
    RuleCase(
        "batch-arithmetic", CPU, ("rollout.max_response_len=4096",), ("rollout.max_response_len=1024",), "context"
    ),
    RuleCase("ports-distinct", (*TINY, *FIXED), ("session.port=30010",), ("session.port=30110",)),
    RuleCase(
        "ports-distinct", (*TINY, *FIXED, "router=sglang"), ("router.port=30001",), ("router.port=30000",),
        "router-session",
    ),
    # glm52's engines of TP 16 have a port per node rank (30010..30013), and meet on engine.dist_init_port.
    RuleCase("ports-distinct", (*GLM, *FIXED), ("session.port=30013",), ("session.port=30014",), "node-rank-ports"),
    RuleCase("ports-distinct", (*GLM, *FIXED), ("engine.dist_init_port=30001",), ("engine.dist_init_port=30200",),
             "dist-init-port"),
    # engine1 of TWO_DEVICE_TRAINER spans nodes 0 and 1 (2 + 2 devices) though TP 4 fits a node: rank 1 on 30013.
    RuleCase("ports-distinct", (*TWO_DEVICE_TRAINER, *FIXED), ("session.port=30013",), ("session.port=30014",),
             "straddling-engine"),
    RuleCase("ports-distinct", (*TWO_DEVICE_TRAINER, *FIXED), ("engine.dist_init_port=30001",),
             ("engine.dist_init_port=30200",), "straddling-engine-dist-init"),  # engine1 meets on 30011, serves there
    # ---- settings one backend honours; what this release has not built ----
    RuleCase("full-weight-training-not-built", CPU, FULL_WEIGHTS, ()),
    RuleCase("fully-async-not-built", CPU, FULLY_ASYNC, ASYNC),
    RuleCase("fsdp-trainer-on-gpus-not-built", ("cluster=gpu_1x", "engine=sglang"), (),
             ("cluster=cpu", "engine=embedded")),
    RuleCase("train-only-adapter-not-built", CPU, ("adapters.train_only=true",), ("adapters.train_only=false",)),
    RuleCase("embedded-engine-within-a-node", TWO_CPU_NODES, ("engine.tp_size=2",), ("engine.tp_size=1",)),
    RuleCase("multi-node-session-host", (*TINY, "executor=ray", "cluster.nodes=2"), ("session.host=0.0.0.0",),
             ("session.host=127.0.0.1",)),
    RuleCase(
        "embedded-engine-takes-no-sglang-gpu-settings", CPU,
        ("engine.mem_fraction_static=0.5",), ("engine.mem_fraction_static=0.8",),
    ),
    RuleCase(
        "embedded-engine-takes-no-sglang-gpu-settings", CPU,
        ("engine.extra_args=[--max-running-requests,8]",), ("engine.extra_args=[]",), "extra-args",
    ),
    RuleCase(
        "embedded-engine-takes-no-sglang-gpu-settings", CPU,
        ("engine.enable_cuda_graph=false",), ("engine.enable_cuda_graph=true",), "cuda-graph",
    ),
    RuleCase(
        "embedded-engine-takes-no-sglang-gpu-settings", CPU,
        ("adapters.base_cpu_backup=true",), ("adapters.base_cpu_backup=false",), "cpu-backup",
    ),
    RuleCase(
        "cpu-backup-needs-colocated-lora-rollout", QWEN30_DISAGG,
        ("adapters.base_cpu_backup=true",), ("adapters.base_cpu_backup=false",),
    ),
    RuleCase(
        "megatron-lora-layouts-need-megatron", CPU,
        ("adapters.lora_type=canonical_lora",), ("adapters.lora_type=lora",),
    ),
    RuleCase(
        "megatron-lora-layouts-need-megatron", CPU,
        ("adapters.experts_shared_outer=true",), ("adapters.experts_shared_outer=false",), "shared-outer",
    ),
    RuleCase("fsdp-pads-rows", CPU, ("trainer.parallel.qkv_format=thd",), ("trainer.parallel.qkv_format=bshd",)),
    RuleCase(
        "offload-needs-megatron", ("cluster=gpu_1x", "engine=sglang"),
        ("topology.offload_train=true",), ("topology.offload_train=false",),
    ),
    RuleCase("rollout-offload-needs-sync-schedule", ASYNC, ("topology.offload_rollout=true",),
             ("topology.offload_rollout=false",)),
    RuleCase("multi-lora-rollout-offload-not-built", TINY_MULTI, ("topology.offload_rollout=true",),
             ("topology.offload_rollout=false",)),
    RuleCase("rollout-offload-engine-restarts-not-built", ("topology.offload_rollout=true",),
             ("executor.engine_restarts=1",), ("executor.engine_restarts=0",)),
    RuleCase(
        "host-memory-holds-cpu-plan", CPU, ("cluster.memory_gb_per_node=0.001",), ("cluster.memory_gb_per_node=24",)
    ),
    RuleCase("cpu-cluster-runs-no-gpu-components", CPU, ("cluster.gpu_type=H100",), ("cluster.gpu_type=none",),
             "gpu-type"),
    RuleCase("starting-adapter-fits-plan", CPU, ("adapters.path=/no/such/adapter",), ("adapters.path=''",)),
    RuleCase("starting-adapter-fits-plan", TINY_MULTI, ("adapters.path=/no/such/adapter",), ("adapters.path=''",),
             "multi"),
    # ---- the model description matches its checkpoint ----
    RuleCase("model-matches-checkpoint", CPU, ("model.num_layers=4",), ("model.num_layers=2",)),
    RuleCase("model-matches-checkpoint", CPU, ("model.hidden_size=128",), ("model.hidden_size=64",), "hidden"),
    RuleCase("model-matches-checkpoint", CPU, ("model.moe_topk=4",), ("model.moe_topk=2",), "topk"),
    RuleCase("model-matches-checkpoint", CPU, ("model.family=qwen2",), ("model.family=qwen3_moe",), "family"),
    RuleCase(
        "model-matches-checkpoint", CPU, ("model.max_context_len=4096",), ("model.max_context_len=1024",), "context"
    ),
    RuleCase("served-model-name-has-no-colon", CPU, ("model.name=org:tiny",), ("model.name=org-tiny",)),
    # ---- a stock SGLang plan uses no feature only the sglang-miles fork serves ----
    RuleCase("stock-sglang-has-no-lora-broadcast", CPU_DISAGG, ("engine.build=stock",), ("engine.build=miles_fork",)),
    RuleCase("stock-sglang-has-no-lora-broadcast", CPU_DISAGG, ("engine.build=stock",),
             ("engine.build=stock", "topology=colocated"), "colocated"),
    RuleCase("stock-sglang-has-no-lora-upsert", CPU_DISAGG, ("engine.build=stock", "pause_generation_mode=in_place"),
             ("engine.build=miles_fork", "pause_generation_mode=in_place")),
    RuleCase("stock-sglang-has-no-lora-upsert", TINY_MULTI, ("engine.build=stock",), ("engine.build=miles_fork",),
             "multi"),
    RuleCase("stock-sglang-has-no-prefix-abort", TINY_MULTI, ("engine.build=stock",), ("engine.build=miles_fork",)),
    # ---- estimators, optimizer, trainer and rollout switches, the metrics file ----
    RuleCase("ppo-needs-critic", CPU, (f"{ESTIMATOR}=ppo",), (f"{ESTIMATOR}=reinforce_plus_plus",)),
    RuleCase("gamma-needs-reinforce", CPU, ("algorithm.gamma=0.9",),
             ("algorithm.gamma=0.9", f"{ESTIMATOR}=reinforce_plus_plus")),
    RuleCase("muon-needs-whole-matrices", CPU, ("optimizer.name=muon",),
             ("optimizer.name=muon", "topology.actor_num_gpus_per_node=1")),
    RuleCase("fsdp-optimizer-is-distributed", CPU, ("optimizer.use_distributed_optimizer=false",),
             ("optimizer.use_distributed_optimizer=false", "topology.actor_num_gpus_per_node=1")),
    RuleCase("dynamic-batch-token-budget", CPU, ("trainer.use_dynamic_batch_size=true", "trainer.max_tokens_per_gpu=0"),
             ("trainer.use_dynamic_batch_size=true", "trainer.max_tokens_per_gpu=512")),
    RuleCase("dynamic-batch-token-budget", CPU, ("trainer.max_tokens_per_gpu=512",),
             ("trainer.max_tokens_per_gpu=512", "trainer.use_dynamic_batch_size=true"), "unused-budget"),
    RuleCase("keep-old-actor-not-built", ASYNC, ("trainer.keep_old_actor=true",), ("trainer.keep_old_actor=false",)),
    RuleCase("group-rm-not-built", CPU, ("rollout.group_rm=true",), ("rollout.group_rm=false",)),
    RuleCase("partial-rollout-not-built", CPU, ("rollout.partial_rollout=true",), ("rollout.partial_rollout=false",)),
    RuleCase("prefill-logprob-recompute-not-built", CPU, ("rollout.recompute_logprobs_via_prefill=true",),
             ("rollout.recompute_logprobs_via_prefill=false",)),
    RuleCase("metrics-jsonl-needed-to-resume", CPU, ("logger.metrics_jsonl=false", "run.resume=true"),
             ("logger.metrics_jsonl=false", "run.resume=false")),
    RuleCase("tito-model-fits-tokenizer", TINY, ("session.tito_model=glm47", "session.max_trim_tokens=1"),
             ("session.tito_model=qwen3",)),
    RuleCase("tito-model-needs-trim", GLM, ("session.max_trim_tokens=0",), ("session.max_trim_tokens=1",)),
    RuleCase("api-key-env-is-a-variable-name", CPU, ("security.api_key_env=my-key",),
             ("security.api_key_env=MILES_API_KEY",)),
    RuleCase("rollout-within-engine-limits", CPU, ("engine.max_batch_size=2",), ("engine.max_batch_size=4",)),
    RuleCase("rollout-within-engine-limits", CPU, ("rollout.n_samples_per_prompt=300",),
             ("rollout.n_samples_per_prompt=300", "engine.max_n=300"), variant="n"),
    RuleCase("sglang-engine-has-no-request-limits", QWEN05, ("engine.max_n=8",), ()),
]
# fmt: on

# Rejections whose `fix:` is not an override to paste: the rule gives none for a single list item.
FIX_NOT_PASTEABLE: dict[str, str] = {}
# Fixes that do not clear their rule: bugs in the rule, documented here until fixed (see the report).
FIX_BUGS: dict[str, str] = {}  # case id -> reason, for fixes known not to clear their rule


def case_params(cases: list[RuleCase], marks: dict[str, pytest.MarkDecorator] | None = None) -> list:
    marks = marks or {}
    return [pytest.param(c, id=c.case_id, marks=[marks[c.case_id]] if c.case_id in marks else []) for c in cases]


def rule_ids(problems: list) -> set[str]:
    return {p.rule for p in problems}


def test_every_rule_has_a_case():
    covered = {c.rule_id for c in CASES}
    missing = sorted((set(RULES) | set(PRECONDITIONS)) - covered)
    assert not missing, f"rules without a RuleCase in tests/plan/test_rules.py: {missing}"


def test_every_case_names_a_real_rule():
    assert {c.rule_id for c in CASES} <= set(RULES) | set(PRECONDITIONS)


def test_case_ids_are_unique():
    ids = [c.case_id for c in CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", case_params(CASES))
def test_bad_config_is_rejected_by_its_rule(case, outcome):
    result = outcome(case.bad)
    assert isinstance(result, PlanError), f"{case.bad} compiled to a Plan"
    assert case.rule_id in rule_ids(result.problems), str(result)


@pytest.mark.parametrize("case", case_params(CASES))
def test_good_config_compiles(case, plan):
    plan(case.good)


@pytest.mark.parametrize("case", case_params(CASES))
def test_rejection_names_settings_reason_and_origin(case, problems):
    for problem in (p for p in problems(case.bad) if p.rule == case.rule_id):
        assert problem.settings, problem
        assert problem.reason.strip(), problem
        for setting, origin in problem.settings:
            assert "=" in setting, problem
            assert origin.startswith(("default", "group option", "recipe", "command line")), problem


def fix_marks() -> dict[str, pytest.MarkDecorator]:
    skips = {k: pytest.mark.skip(reason=v) for k, v in FIX_NOT_PASTEABLE.items()}
    return skips | {k: pytest.mark.xfail(strict=True, reason=v) for k, v in FIX_BUGS.items()}


@pytest.mark.parametrize("case", case_params(CASES, fix_marks()))
def test_pasting_the_fix_clears_the_rule(case, problems):
    fixes = [p.fix for p in problems(case.bad) if p.rule == case.rule_id]
    assert fixes and all(fixes), f"{case.case_id}: the rejection offers no fix"
    pasted = [override for fix in dict.fromkeys(fixes) for override in fix.split(" ")]
    assert case.rule_id not in rule_ids(problems([*case.bad, *pasted])), pasted


def test_every_not_built_refusal_is_left_out_of_the_design():
    # compile_design and the Slurm launcher's NOT SUBMITTABLE preview skip exactly NOT_BUILT.
    assert {rule_id for rule_id in RULES if rule_id.endswith("-not-built")} <= set(NOT_BUILT)


# ---- the Megatron trainer runs on a CPU cluster (gloo), with its model parallelism ----


@pytest.mark.parametrize(
    "layout",
    [(), ("trainer.parallel.tp=2",), ("trainer.parallel.ep=2",), ("model=tiny_dense",)],
    ids=["dp2", "tp2", "ep2", "dense"],
)
def test_the_megatron_trainer_runs_on_a_cpu_cluster(layout, problems):
    assert problems([*MEGATRON_CPU, *layout]) == []


# ---- how list items (adapters.runs[i]) are shown ----


def problem_of(rule_id: str, overrides: list[str], problems) -> Problem:
    return next(p for p in problems(overrides) if p.rule == rule_id)


def test_list_item_set_on_the_command_line_is_shown_as_such(problems):
    problem = problem_of("adapter-names-unique-and-safe", [*TINY_MULTI, "adapters.runs.0.name=../arith"], problems)
    assert problem.settings == [("adapters.runs[0].name=../arith", "command line")]


@pytest.mark.parametrize(
    ("rule_id", "overrides"),
    [
        ("adapter-fits-engine", [*TINY_MULTI, TINY_RUNS.format(first="{name: arith, target_modules: [gate_proj]}")]),
        ("adapter-batch-shape", [*TINY_MULTI, TINY_RUNS.format(first="{name: arith, rollout_batch_size: 64}")]),
    ],
    ids=["list-value", "inherited-value"],
)
def test_list_item_values_are_shown_in_override_syntax(rule_id, overrides, problems):
    shown = " ".join(setting for setting, _ in problem_of(rule_id, overrides, problems).settings)
    assert "'" not in shown and "None" not in shown, shown


def test_unset_list_item_field_gets_a_working_hint(problems):
    problem = problem_of("unset-list-item-field", [*TINY_MULTI, "adapters.runs.0.rollout_batch_size=32"], problems)
    assert "adapters.runs.0.rollout_batch_size" in problem.fix, problem


# ---- combinations that once slipped through ----


def test_service_mode_needs_at_least_one_slot(problems):
    found = problems([*TINY_MULTI, "adapters.runs=[]", "adapters.service_mode=true", "adapters.max_slots=0"])
    assert any(s.startswith("adapters.max_slots=") for p in found for s, _ in p.settings), found


def test_adapter_needs_at_least_one_prompt(problems):
    found = problems([*TINY_MULTI, TINY_RUNS.format(first="{name: arith, rollout_batch_size: 0}")])
    assert "adapter-batch-shape" in rule_ids(found)


# ---- engines wider than a node ----


def test_only_an_embedded_engine_wider_than_a_node_is_refused(problems):
    # glm52's SGLang engines span two nodes each: SGLang runs them (--nnodes), and the recipe compiles.
    assert not problems(GLM)
    sglang_wide = ["cluster=gpu_1x", "cluster.nodes=2", "engine=sglang", "engine.tp_size=2", "executor=ray"]
    assert "embedded-engine-within-a-node" not in rule_ids(problems(sglang_wide))
    refused = problem_of("embedded-engine-within-a-node", [*TWO_CPU_NODES, "engine.tp_size=2"], problems)
    assert "embedded CPU engine is one process" in refused.reason
