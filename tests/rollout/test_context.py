"""A rollout's context is resolved from the plan: its prompts come from the task seeded with run.seed."""

from __future__ import annotations

from miles_runner.config.compose import compose
from miles_runner.plan.compile import compile_plan
from miles_runner.plugins.tasks import PromptStream
from miles_runner.rollout.context import RolloutContext, rollout_engines


async def prompts_of_seed(seed: int) -> list[list[dict]]:
    # The plain tiny model (the `tiny_model_path` fixture builds it): its tokenizer is the context's.
    overrides = ["+recipe=tiny_lora_agentic", "model.path=tiny:tiny-moe", "rollout.task=arith", f"run.seed={seed}"]
    plan = compile_plan(compose(overrides))
    async with rollout_engines(plan, []) as workers:  # not called: the context only holds them
        stream = PromptStream(RolloutContext.from_plan(plan, workers, None).task)
        return [prompt.messages for prompt in stream.next_batch(8)]


async def test_run_seed_picks_the_prompt_stream(tiny_model_path):
    first, again, other = [await prompts_of_seed(seed) for seed in (1, 1, 2)]
    assert first == again
    assert first != other
