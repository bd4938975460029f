"""The Megatron trainer in the whole loop through `miles-run` (the default recipe, `trainer=megatron
lora_mode=raw`, a few greedy steps): two trainer ranks under TP=2 + EP=2 (+SP) train, agree with the engines on
the sampled tokens and save an adapter peft loads; one rank and two ranks give the same run; a run killed after a
checkpoint resumes with no step lost or repeated.

Greedy rollouts (top_k 1), one sample per prompt and REINFORCE++ (advantages normalised over the batch; GRPO's
would be all zero with groups of one), as tests/executors/test_multi_node_ray.py: nothing is left to a sampler's
RNG, so runs of different layouts can be compared step by step.
"""

from __future__ import annotations

import math
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.loops.recipe_runs import miles_run, recipe_command, records, run_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = (
    "trainer=megatron",
    "lora_mode=raw",
    "rollout.top_k=1",
    "rollout.n_samples_per_prompt=1",
    "algorithm.advantage_estimator=reinforce_plus_plus",
    "rollout.rollout_batch_size=8",
    "trainer.parallel.micro_batch_size=4",
)
TWO_RANKS = ("trainer.parallel.tp=2", "trainer.parallel.ep=2", "topology.actor_num_gpus_per_node=2")


def finished_run(root: Path, *overrides: str) -> Path:
    """The run folder of a two-step greedy run under `root`, finished."""
    done = miles_run(root, *GREEDY, "algorithm.num_steps=2", *overrides, fault=False, timeout_s=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [plan] = root.rglob("plan.yaml")
    return plan.parent


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "adapter" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_run(tmp_path_factory.mktemp("one_rank"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return finished_run(tmp_path_factory.mktemp("two_ranks"), *TWO_RANKS)


def test_two_ranks_under_tp2_ep2_train_with_the_engines_logprobs_and_save_a_peft_adapter(two_ranks):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from miles_runner.models.tiny_model import ensure_tiny_model

    steps = records(two_ranks)
    assert [r["step"] for r in steps] == [0, 1]
    assert all(math.isfinite(r["reward/mean"]) and math.isfinite(r["train/loss"]) for r in steps)
    assert all(r["train/logprob_abs_diff"] < 1e-4 for r in steps), "trainer and engine disagree on the tokens"
    assert "miles_runner.trainer.ranks" in (two_ranks / "logs" / "trainer1.log").read_text()  # rank 1 ran
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny_model("tiny-moe"), dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    before = base(ids).logits
    tuned = PeftModel.from_pretrained(base, two_ranks / "adapter")
    assert not torch.allclose(tuned(ids).logits, before), "the saved adapter changes nothing"


def test_one_rank_and_two_ranks_give_the_same_rewards_and_adapter(one_rank, two_ranks):
    one, two = records(one_rank), records(two_ranks)
    # Greedy tokens: the same episodes, so the same rewards, step by step (step 1 under the trained adapter).
    assert [r["reward/mean"] for r in two] == [r["reward/mean"] for r in one]
    a, b = adapter(two_ranks), adapter(one_rank)
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"1 vs 2 ranks (TP2 EP2): max |adapter difference| {worst:.3g}")
    assert worst < 1e-5
    assert any(b[k].abs().sum() > 0 for k in b if "lora_B" in k), "the adapter never trained: nothing compared"


def test_a_run_killed_after_a_checkpoint_resumes_with_no_step_lost_or_repeated(tmp_path):
    # Four steps: on an idle machine a step takes about 0.2 s, so the kill after the second record can land
    # after the third; the fourth is then still ahead (the FSDP twin in tests/loops/test_driver.py does the same).
    shape = (*GREEDY, "algorithm.num_steps=4", "checkpoint.interval=1")
    first = subprocess.Popen(
        recipe_command(tmp_path, *shape), env=run_env(fault=False), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 300
        while len(records(tmp_path)) < 2 and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    before = records(tmp_path)
    assert 2 <= len(before) < 4, f"the run was stopped after {len(before)} steps, not 2 or 3"
    [plan] = tmp_path.rglob("plan.yaml")
    resumed = miles_run(tmp_path, *shape, f"run.dir={plan.parent}", "run.resume=true", fault=False, timeout_s=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = records(tmp_path)
    assert [r["step"] for r in after] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in after] == [1, 2, 3, 4]
    # Step 0 was not done again (its timings would differ); the last recorded step may be, when the kill came
    # before its checkpoint.
    assert after[0] == before[0]
