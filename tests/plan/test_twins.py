"""Each CPU twin's plan is its GPU recipe's plan, field by field, but for a short reviewed list: what the cluster
(two CPU devices), the model's size (the tiny MoE) and the engine kind (embedded) change, and the workload the tiny
model can learn in a CI run. A difference anywhere else (a pause mode, R3, offload, the router, the session
version, the LoRA path, the trainer backend, TIS, staleness, ...) fails here: the twin would no longer run the GPU
recipe's path."""

from __future__ import annotations

import fnmatch
import re
from typing import Any

import pytest

from miles_runner.plan.compile import compile_design
from miles_runner.plan.model import plan_to_dict

TWINS = {
    "tiny_qwen3_30b_a3b_r3_session": "qwen3_30b_a3b_r3_session",
    "tiny_multi_lora_math": "multi_lora_math",
    "tiny_glm52_lora_agentic": "glm52_lora_agentic",
}

CLUSTER = "the cluster: one node of two CPU devices, no GPU"
MODEL = "the model's size: the tiny MoE (same family and MoE routing, 2 layers)"
ENGINE = (
    "the engine kind: the embedded engine is one process (TP 1, no CUDA devices) speaking the miles fork's protocol"
)
MULTI_NODE = CLUSTER + ": one node on loopback (GPU: servers on the nodes' addresses, engines over two nodes)"
WORKLOAD = "the workload: a task, batch and lr the tiny model learns in 40 steps (the GPU one's data is on the cluster)"
# Plan fields (dotted; a list's items by index, * for any) a twin may change, and why.
REVIEWED: dict[str, str] = {
    "name": "the twin's own name",
    "recipe": "the twin's own name",
    "cluster.*": CLUSTER,
    "trainer.placements": CLUSTER,
    "trainer.parallel.tp": CLUSTER + ": 2 ranks, TP 1 x EP 2 (GPU: TP 2 x EP 8 over 8)",
    "trainer.parallel.ep": CLUSTER,
    "trainer.parallel.dp": CLUSTER,
    "trainer.parallel.world_size": CLUSTER,
    "trainer.parallel.micro_batch_size": CLUSTER + ": fewer, larger forward passes on CPU",
    "trainer.host.*": CLUSTER + ": Megatron-Bridge's Python 3.12 environment hosts the trainer",
    "trainer.host": CLUSTER,
    "weight_sync.max_logprob_gap": CLUSTER + ": fp32 on CPU, bf16 kernels on GPU (derived)",
    "model.*": MODEL,
    "model_path": MODEL,
    "engines.*.kind": ENGINE,
    "engines.*.build": ENGINE,
    "engines.*.tp_size": ENGINE,
    "engines.*.ep_size": ENGINE,
    "engines.*.device_ids": ENGINE,
    "engines.*.launch.env.CUDA_VISIBLE_DEVICES": ENGINE,
    "algorithm.num_steps": WORKLOAD,
    "optimizer.lr": WORKLOAD,
    "rollout.task": WORKLOAD,
    "rollout.reward": WORKLOAD,
    "rollout.data": WORKLOAD,
    "rollout.rollout_batch_size": WORKLOAD,
    "rollout.max_response_len": WORKLOAD,
    "rollout.max_turns": WORKLOAD,
    "adapters.*.task": WORKLOAD,
    "adapters.*.reward": WORKLOAD,
    "adapters.*.data": WORKLOAD,
    "adapters.*.lr": WORKLOAD,
    "adapters.*.rollout_batch_size": WORKLOAD,
    "batch.*": WORKLOAD,
    "adapters.*.name": WORKLOAD + " (each adapter named after its task)",
    "adapters.*.num_step": WORKLOAD,
    "algorithm.global_batch_size": WORKLOAD,
    "multi_lora.max_adapter_global_batch_size": WORKLOAD + " (4 x the global batch, derived)",
    "engines.*.node_ranks*": MULTI_NODE,
    "engines.*.nodes": MULTI_NODE,
    "*.launch.host": MULTI_NODE,
    "engines.2.*": CLUSTER + ": two engines on CPU devices (GPU: four)",
    "engines.3.*": CLUSTER + ": two engines on CPU devices (GPU: four)",
}
# Command-line flags the same reasons change; every other flag of a server's command must be the same.
REVIEWED_FLAGS = {
    "--model-path": MODEL,
    "--served-model-name": MODEL,
    "--context-length": MODEL,
    "--tp-size": ENGINE,
    "--ep-size": ENGINE,
    "--mem-fraction-static": ENGINE + " (a GPU memory setting)",
    "--lora-backend": ENGINE + " (SGLang's kernels)",
    "--engine-build": ENGINE,
    "--max-n": ENGINE + " (its request limits; SGLang has none)",
    "--max-batch-size": ENGINE,
    "--worker-urls": CLUSTER + ": the router's workers are the twin's engines",
    "--host": MULTI_NODE,
    "--prometheus-host": MULTI_NODE,
    "--router-url": MULTI_NODE,
    "--dist-init-addr": MULTI_NODE,
    "--nnodes": MULTI_NODE,
    "--node-rank": MULTI_NODE,
    "--dp-size": ENGINE + " (SGLang's DP attention)",
    "--enable-dp-attention": ENGINE + " (SGLang's DP attention)",
    "--quantization": ENGINE + " (FP8 rollout is SGLang's GPU kernels; the GPU check runs it)",
}


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted paths to leaves; lists of mappings are indexed, an argv becomes its program and flags."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flat(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}[{i}]").items()}
    if prefix.endswith(".argv"):
        return flat(flags(value), prefix)
    return {prefix: value}


def flags(argv: list[str]) -> dict[str, Any]:
    """An argv as {"program": the module or binary, "--flag": its values}."""
    start = 3 if argv[:2] == ["python", "-m"] else 1
    parsed: dict[str, Any] = {"program": " ".join(argv[:start]) if start == 1 else argv[2]}
    flag = None
    for arg in argv[start:]:
        if arg.startswith("--"):
            flag = arg
            parsed[flag] = []
        elif flag is not None:
            parsed[flag].append(arg)
    return parsed


def reviewed(path: str) -> bool:
    general = re.sub(r"\[(\d+)\]", r".\1", path)  # engines[0].kind -> engines.0.kind
    if any(fnmatch.fnmatchcase(general, pattern) for pattern in REVIEWED):
        return True
    head, _, flag = general.rpartition(".")
    if head.endswith(".argv"):
        return flag in REVIEWED_FLAGS or (flag == "program" and head.startswith("engines."))
    return False


def plan_fields(composed, recipe: str) -> dict[str, Any]:
    return flat(plan_to_dict(compile_design(composed((f"+recipe={recipe}",)))))


@pytest.mark.parametrize(("twin", "gpu"), TWINS.items(), ids=list(TWINS))
def test_a_twin_differs_from_its_gpu_recipe_only_where_reviewed(twin, gpu, composed):
    mine, theirs = plan_fields(composed, twin), plan_fields(composed, gpu)
    differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k, "<absent>") != theirs.get(k, "<absent>"))
    unreviewed = [
        f"{k}: {theirs.get(k, '<absent>')!r} -> {mine.get(k, '<absent>')!r}" for k in differ if not reviewed(k)
    ]
    assert not unreviewed, "\n".join(unreviewed)
    # The choices that make the GPU recipe's path: the same, not merely unreviewed.
    for key in ("trainer.backend", "trainer.lora_mode", "topology", "weight_sync.pause_generation_mode"):
        assert mine[key] == theirs[key], key


def test_the_comparison_sees_a_changed_choice(composed):
    """The guard itself: a twin that drifted (another pause mode) is caught."""
    mine = flat(
        plan_to_dict(
            compile_design(composed(("+recipe=tiny_qwen3_30b_a3b_r3_session", "pause_generation_mode=retract")))
        )
    )
    theirs = plan_fields(composed, "qwen3_30b_a3b_r3_session")
    assert not reviewed("weight_sync.pause_generation_mode")
    assert mine["weight_sync.pause_generation_mode"] != theirs["weight_sync.pause_generation_mode"]
