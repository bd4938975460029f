"""Single-turn rollout: one `/generate` per sample (token in, token out), n samples per prompt, group-ordered.

A prompt's group goes to one engine (engine/workers.py: least-loaded over the router's healthy workers, else
the plan's engines), so its samples share the prompt's prefix cache and groups spread over every engine. The
requests go straight to that worker, never through the router, which drops the R3 request fields.

Under routing replay (R3) each request asks for the routed experts, and the sample carries them as the engine
returned them: ``(len(tokens) - 1, num_layers, top_k)``, row i the routing of token i.
"""

from __future__ import annotations

import asyncio
import uuid

from miles_runner.engine import response
from miles_runner.engine.client import EngineClient
from miles_runner.plugins.tasks import Prompt
from miles_runner.rollout.context import RolloutContext
from miles_runner.session.samples import STATUS_OF_FINISH, Sample, SampleStatus


async def rollout_single_turn(ctx: RolloutContext, prompts: list[Prompt]) -> list[Sample]:
    groups = await asyncio.gather(*(sample_group(ctx, prompt) for prompt in prompts))
    return [sample for group in groups for sample in group]


async def sample_group(ctx: RolloutContext, prompt: Prompt) -> list[Sample]:
    """The prompt's n samples, all generated on the one worker the group is pinned to while in flight."""
    group = f"p{prompt.index}-{uuid.uuid4().hex[:8]}"
    async with ctx.workers.lease(group) as engine:
        n = ctx.plan.batch.n_samples_per_prompt
        return list(await asyncio.gather(*(sample_one(ctx, engine, prompt, f"{group}-s{k}") for k in range(n))))


async def sample_one(ctx: RolloutContext, engine: EngineClient, prompt: Prompt, rid: str) -> Sample:
    fields = {"rid": rid}
    if ctx.lora_name:
        fields["lora_path"] = ctx.lora_name
    return await generate_sample(ctx, engine, prompt, fields)


async def generate_sample(
    ctx: RolloutContext, engine: EngineClient, prompt: Prompt, request_fields: dict[str, str]
) -> Sample:
    """One /generate of `prompt` on `engine` with `request_fields` (rid, and lora_path/extra_key when set), scored."""
    prompt_ids = ctx.tokenizer.first_turn_ids(prompt.messages, None, {})
    payload = {
        "input_ids": prompt_ids,
        "sampling_params": ctx.sampling_params(),
        "return_logprob": True,
        **request_fields,
    }
    if ctx.routed_experts_layers is not None:
        payload["return_routed_experts"] = True
    result = await engine.generate(payload)
    output_ids, log_probs = response.output_token_logprobs(result)
    routed = None
    if ctx.routed_experts_layers is not None:
        routed = response.routed_experts(result, num_layers=ctx.routed_experts_layers)
    text = result.get("text", "")
    return Sample(
        tokens=prompt_ids + output_ids,
        response_length=len(output_ids),
        loss_mask=[1] * len(output_ids),
        rollout_log_probs=log_probs,
        rollout_routed_experts=routed,
        status=STATUS_OF_FINISH.get(response.finish_reason_type(result) or "", SampleStatus.ABORTED),
        response=text,
        weight_versions=[str(response.weight_version(result))],
        metadata={"prompt_index": prompt.index, "label": prompt.label},
        reward=ctx.reward(prompt, [text]),
    )
