"""The adapter push cadence end to end on CPU (real engine, trainer and sync): the engines get a new weight version
only every `weight_sync.update_weights_interval` steps and after the last one, every step records the version
its rollout came from and the one it trained at, every push is verified, and a resumed run keeps the schedule
and gives the engines the checkpoint's adapter.

The loop is the real SingleAdapterLoop; the subclass below only reads the engines themselves (not the loop's
bookkeeping) at each step and before they stop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from miles_runner.loops.single_adapter import SingleAdapterLoop
from miles_runner.plan.model import Plan
from miles_runner.plan.record import read_plan
from miles_runner.sglang_client.client import EngineClient

from .recipe_runs import recorded_run, records

pytestmark = pytest.mark.slow

BASE = (
    "+recipe=tiny_lora_agentic",
    "session=off",
    "rollout.task=arith",
    "rollout.reward=exact_match",
    "rollout.max_turns=1",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "algorithm.use_tis=true",
    "checkpoint.interval=1",
    "logger=none",
)
PROBE_IDS = [5, 6, 7, 8, 9, 10]


class Crash(RuntimeError):
    """Stands for the run being killed right after a checkpoint."""


class ObservedLoop(SingleAdapterLoop):
    """The real loop; records what the engines report when each step's batch is taken, and at the end."""

    def __init__(self, plan: Plan, run_dir: Path, *, resume: bool = False, crash_after: int | None = None):
        super().__init__(plan, run_dir, resume=resume)
        self.crash_after = crash_after
        self.next_step = 0  # the step whose rollout is generated next
        self.versions_at: dict[int, list[str]] = {}
        self.final_versions: list[str] = []
        self.final_probe: dict[str, Any] = {}

    async def _rollout(self, parts, prompts):
        rolled = await super()._rollout(parts, prompts)  # the sync schedule: one batch per step, in order
        self.versions_at[self.next_step] = await engine_versions(parts.ctx.plan)  # as it runs: its ports chosen
        self.next_step += 1
        return rolled

    async def _steps(self, parts, start):
        self.next_step = start
        await super()._steps(parts, start)
        self.final_versions = await engine_versions(parts.ctx.plan)
        self.final_probe = await greedy_probe(parts.ctx.plan)

    def _checkpoint(self, trainer, stream, done, *, taken_ahead):
        super()._checkpoint(trainer, stream, done, taken_ahead=taken_ahead)
        if done == self.crash_after:
            raise Crash(f"killed after checkpoint step_{done}")


async def engine_versions(plan: Plan) -> list[str]:
    versions = []
    for engine in plan.engines:
        async with EngineClient(engine.launch.url) as client:
            versions.append(await client.weight_version())
    return versions


async def greedy_probe(plan: Plan) -> dict[str, Any]:
    """What the engine's adapter (plan.adapters[0]) generates greedily for PROBE_IDS, with logprobs."""
    async with EngineClient(plan.engines[0].launch.url) as client:
        out = await client.generate(
            {
                "input_ids": PROBE_IDS,
                "lora_path": plan.adapters[0].lora_name,
                "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
                "return_logprob": True,
            }
        )
    triples = out["meta_info"]["output_token_logprobs"]
    return {"ids": [t[1] for t in triples], "logprobs": [t[0] for t in triples]}


def saved_adapter_logprobs(run_dir: Path, ids: list[int]) -> list[float]:
    """The logprobs of `ids` after PROBE_IDS under the adapter the run saved, by peft on the base model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    plan = read_plan(run_dir / "plan.yaml")
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(plan.model_path), run_dir / "adapter")
    tokens = torch.tensor([PROBE_IDS + ids])
    with torch.no_grad():
        logits = model(tokens).logits[0, len(PROBE_IDS) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()


def column(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [row.get(key) for row in rows]


@pytest.fixture(scope="module")
def every_third_step(tmp_path_factory) -> tuple[ObservedLoop, Path]:
    """Five steps pushing every 3: pushes after steps 2 and 4 (the last), none after 0, 1, 3."""
    run_dir = recorded_run(
        tmp_path_factory.mktemp("interval3"),
        BASE,
        "algorithm.num_steps=5",
        "weight_sync.update_weights_interval=3",
        "rollout.max_weight_staleness=2",
    )
    loop = ObservedLoop(read_plan(run_dir / "plan.yaml"), run_dir)
    loop.run()
    return loop, run_dir


def test_the_engines_weight_version_changes_only_every_interval_steps_and_after_the_last(every_third_step):
    loop, _ = every_third_step
    assert loop.versions_at == {0: ["0"], 1: ["0"], 2: ["0"], 3: ["3"], 4: ["3"]}
    assert loop.final_versions == ["5"]


def test_each_step_records_the_version_it_rolled_out_at_and_the_one_it_trained_at(every_third_step):
    _, run_dir = every_third_step
    steps = records(run_dir)
    assert column(steps, "rollout/weight_version") == [0, 0, 0, 3, 3]
    assert column(steps, "train/weight_version") == [0, 1, 2, 3, 4]
    assert column(steps, "train/weight_staleness") == [0, 1, 2, 0, 1]
    assert column(steps, "weight_version") == [0, 0, 3, 3, 5]  # the engines' version once the step is done
    assert [r["step"] for r in steps if "sync/seconds" in r] == [2, 4]


def test_every_push_is_probed_on_the_engine_against_the_trainer(every_third_step):
    _, run_dir = every_third_step
    verified = {r["step"]: r["verify/logprob_gap"] for r in records(run_dir) if "verify/logprob_gap" in r}
    assert sorted(verified) == [2, 4]  # the pushes after steps 2 and 4
    assert max(verified.values()) < 1e-4  # fp32 on both sides: the pushed adapter is the trainer's
    # ... handed over as the trainer's own parameters, which live in shared memory the engine loads from
    assert [r["sync/shared_memory"] for r in records(run_dir) if "sync/seconds" in r] == [1.0, 1.0]


def test_the_final_adapter_is_the_one_the_engines_serve(every_third_step):
    loop, run_dir = every_third_step
    assert any(r["train/grad_norm"] > 0 for r in records(run_dir)[3:])  # it moved after the push of version 3
    probe = loop.final_probe
    assert saved_adapter_logprobs(run_dir, probe["ids"]) == pytest.approx(probe["logprobs"], abs=1e-4)


def test_a_resumed_run_keeps_the_schedule_and_pushes_the_checkpoint_adapter_first(tmp_path):
    run_dir = recorded_run(
        tmp_path,
        BASE,
        "algorithm.num_steps=5",
        "weight_sync.update_weights_interval=2",
        "rollout.max_weight_staleness=1",
    )
    plan = read_plan(run_dir / "plan.yaml")
    first = ObservedLoop(plan, run_dir, crash_after=3)
    with pytest.raises(Crash):
        first.run()
    resumed = ObservedLoop(plan, run_dir, resume=True)
    resumed.run()

    steps = records(run_dir)
    assert column(steps, "step") == [0, 1, 2, 3, 4]  # none lost, none repeated
    assert first.versions_at == {0: ["0"], 1: ["0"], 2: ["2"]}
    assert resumed.versions_at == {3: ["3"], 4: ["4"]}  # the checkpoint's adapter as version 3, then every 2
    assert resumed.final_versions == ["5"]
    assert steps[3]["rollout/weight_version"] == 3 and steps[3]["verify/logprob_gap"] < 1e-4
    assert max(column(steps, "train/weight_staleness")) <= 1
