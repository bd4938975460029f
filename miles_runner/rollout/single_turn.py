"""Single-turn rollout: one `/generate` per sample (token in, token out), n samples per prompt, group-ordered."""

from __future__ import annotations

import asyncio
import uuid

from miles_runner.engine import response
from miles_runner.plugins.tasks import Prompt
from miles_runner.rollout.context import RolloutContext
from miles_runner.session.samples import STATUS_OF_FINISH, Sample, SampleStatus


async def rollout_single_turn(ctx: RolloutContext, prompts: list[Prompt]) -> list[Sample]:
    n = ctx.plan.batch.n_samples_per_prompt
    return list(await asyncio.gather(*(sample_one(ctx, p, k) for p in prompts for k in range(n))))


async def sample_one(ctx: RolloutContext, prompt: Prompt, k: int) -> Sample:
    fields = {"rid": f"p{prompt.index}-s{k}-{uuid.uuid4().hex[:8]}"}
    if ctx.lora_name:
        fields["lora_path"] = ctx.lora_name
    return await generate_sample(ctx, prompt, fields)


async def generate_sample(ctx: RolloutContext, prompt: Prompt, request_fields: dict[str, str]) -> Sample:
    """One /generate of `prompt` with `request_fields` (rid, and lora_path/extra_key when set), scored."""
    prompt_ids = ctx.tokenizer.first_turn_ids(prompt.messages, None, {})
    payload = {
        "input_ids": prompt_ids,
        "sampling_params": ctx.sampling_params(),
        "return_logprob": True,
        **request_fields,
    }
    result = await ctx.client.generate(payload)
    output_ids, log_probs = response.output_token_logprobs(result)
    text = result.get("text", "")
    return Sample(
        tokens=prompt_ids + output_ids,
        response_length=len(output_ids),
        loss_mask=[1] * len(output_ids),
        rollout_log_probs=log_probs,
        rollout_routed_experts=None,
        status=STATUS_OF_FINISH.get(response.finish_reason_type(result) or "", SampleStatus.ABORTED),
        response=text,
        weight_versions=[str(response.weight_version(result))],
        metadata={"prompt_index": prompt.index, "label": prompt.label},
        reward=ctx.reward(prompt, [text]),
    )
