"""The CPU twin of a GPU recipe runs its exact path end to end and learns: `miles-run +recipe=<twin>` with
the Megatron trainer on Megatron-Bridge's model (hosted by the Python 3.12 environment `make test` builds), behind
the real sglang-router, under the Ray executor (tests/plan/test_twins.py holds each plan to its GPU recipe's). The
qwen3 twin: Bridge LoRA, colocated engines, the session server, in_place pauses, incremental R3 replayed by the
trainer, offload both ways. The glm52 twin: the same path on GLM-5's shape (MLA + DSA + MoE, LoRA on the MLA
linears) with GLM-4.7's TITO, retract pauses, the trainer's state offloaded to disk and the CPU-offloaded optimizer.
The multi_lora_math twin: three adapters in Megatron multi-LoRA slots, disaggregated engines, in_place pauses with
staleness 3, TIS.

The control is test_learning.py's: the same run with the rollouts kept on the initial adapter (and push
verification off, which would otherwise stop it at the first push) must not gain.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from miles_runner.core.paths import source_checkout
from tests.loops.recipe_runs import LEARNING_RUN, MARGIN, WINDOW, gain, records, run_default_recipe
from tests.run_files import files_named

RUN_TIMEOUT_S = 1500  # 35 Megatron-Bridge steps through the session server, on a loaded 2-core machine
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)]

QWEN3_TWIN = "tiny_qwen3_30b_a3b_r3_session"
GLM_TWIN = "tiny_glm52_lora_agentic"
MULTI_LORA_TWIN = "tiny_multi_lora_math"
MULTI_LORA_TIMEOUT_S = 900  # 40 steps of three tiny adapters: about 2 minutes on a quiet 2-core machine
# The spec's colocated step (train.py): the trainer leaves before the engines take their weights back.
STEP_ORDER = ["offload_rollout", "onload_train", "offload_train", "onload_weights", "update_weights", "onload_kv"]


@pytest.fixture(autouse=True)
def bridge_python(monkeypatch):
    """The twin's trainer interpreter, wherever the tests run from."""
    checkout = source_checkout()
    assert checkout is not None
    python = checkout / ".venv-bridge" / "bin" / "python"
    assert python.is_file(), "the Megatron-Bridge environment is missing: make bridge-env (make test builds it)"
    monkeypatch.setenv("MILES_BRIDGE_PYTHON", str(python))


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("twin", [QWEN3_TWIN, GLM_TWIN])
def test_a_colocated_twin_runs_the_gpu_path_and_learns_only_with_its_adapter(tmp_path, twin):
    learned = run_default_recipe(tmp_path / "adapter", LEARNING_RUN, fault=False, recipe=twin, timeout_s=RUN_TIMEOUT_S)
    frozen = run_default_recipe(
        tmp_path / "frozen", f"algorithm.num_steps={2 * WINDOW}", fault=True, recipe=twin, timeout_s=RUN_TIMEOUT_S
    )
    print(
        f"gain with the adapter {gain(learned):+.3f}, with rollouts frozen on the initial adapter {gain(frozen):+.3f}"
    )
    assert gain(learned) >= MARGIN, learned
    assert gain(frozen) < MARGIN, frozen

    [run_dir] = [p.parent for p in files_named(tmp_path / "adapter", "plan.yaml")]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.startswith(f"# trainer: {os.environ['MILES_BRIDGE_PYTHON']} -m miles_runner.trainer.host")
    records = jsonl(run_dir / "metrics.jsonl")
    assert all(r["verify/logprob_gap"] <= 0.01 for r in records)  # every push, after every resume of the engines
    assert all(r["train/routing_replay_diff_frac"] == 0.0 for r in records)  # R3: the trainer routed as the engines
    assert all(r["offload/engine_freed_mb"] > 0 for r in records)
    events = jsonl(run_dir / "offload_events.jsonl")
    for step in range(len(records)):
        order = [e["event"] for e in events if e["iteration"] == step]
        # A checkpoint reads the trainer's state after the step (onloaded by that read), then offloads it again.
        assert order in (STEP_ORDER, [*STEP_ORDER, "offload_train"]), (step, order)


def adapter_gains(records: list[dict]) -> dict[str, float]:
    """Each adapter's last quarter's mean reward minus its first quarter's (its rewards in iteration order)."""
    gains = {}
    for name in ("count", "retry", "letters"):
        rewards = [r[f"{name}/reward/mean"] for r in records if f"{name}/reward/mean" in r]
        quarter = len(rewards) // 4
        gains[name] = sum(rewards[-quarter:]) / quarter - sum(rewards[:quarter]) / quarter
    return gains


def test_the_multi_lora_twin_runs_megatron_slots_and_learns_only_with_its_adapters(tmp_path):
    for root, fault in ((tmp_path / "adapters", False), (tmp_path / "frozen", True)):
        run_default_recipe(root, fault=fault, recipe=MULTI_LORA_TWIN, timeout_s=MULTI_LORA_TIMEOUT_S)
    learned, frozen = adapter_gains(records(tmp_path / "adapters")), adapter_gains(records(tmp_path / "frozen"))
    print(f"gains with the adapters {learned}, with rollouts frozen on the initial adapters {frozen}")
    assert sum(learned.values()) / 3 >= MARGIN, learned
    assert sum(frozen.values()) / 3 < MARGIN, frozen

    [run_dir] = [p.parent for p in files_named(tmp_path / "adapters", "plan.yaml")]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert trainer_log.startswith(f"# trainer: {os.environ['MILES_BRIDGE_PYTHON']} -m miles_runner.trainer.host")
    pushed = [e for e in jsonl(run_dir / "multi_lora_events.jsonl") if e["event"] == "pushed"]
    gaps = [gap for e in pushed for gap in e["probe_gaps"].values()]
    assert len(gaps) >= 3 * 10 and max(gaps) <= 0.01  # every push of every slot scored alike by both engines
