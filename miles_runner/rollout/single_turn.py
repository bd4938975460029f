"""Single-turn rollout: one batch `/generate` per prompt group (token in, token out), n samples per prompt,
group-ordered.

A group is one request whose `input_ids` lists the prompt n times with one rid per sample (SGLang's batch form,
answered as a list in input order), not n requests: per sample it is what n single requests would be (the same
rids, sampling params, logprobs and routed experts), for an eighth of the HTTP round trips and request parsing.

A prompt's group goes to one engine (sglang_client/engine_pool.py: least-loaded over the engines the router lists as
healthy, else the plan's engines), so its samples share the prompt's prefix cache and groups spread over every engine.
The requests go straight to that engine, never through the router, which drops the R3 request fields.

Under routing replay (R3) each request asks for the routed experts, and the sample carries them as the engine
returned them: ``(len(tokens) - 1, num_layers, top_k)``, row i the routing of token i.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, cast

from miles_runner.plugins.tasks import Prompt
from miles_runner.rollout.context import RolloutContext
from miles_runner.session.samples import STATUS_OF_FINISH, Sample, SampleStatus
from miles_runner.sglang_client import response
from miles_runner.sglang_client.client import EngineClient


async def rollout_single_turn(ctx: RolloutContext, prompts: list[Prompt]) -> list[Sample]:
    groups = await asyncio.gather(*(sample_group(ctx, prompt) for prompt in prompts))
    return [sample for group in groups for sample in group]


async def sample_group(ctx: RolloutContext, prompt: Prompt) -> list[Sample]:
    """The prompt's n samples, all generated on the one engine the group is pinned to while in flight."""
    group = f"p{prompt.index}-{uuid.uuid4().hex[:8]}"
    async with ctx.engines.lease(group) as engine:
        rids = [f"{group}-s{k}" for k in range(ctx.plan.batch.n_samples_per_prompt)]
        fields = {"lora_path": ctx.lora_name} if ctx.lora_name else {}
        return await generate_group(ctx, engine, prompt, rids, fields)


async def generate_group(
    ctx: RolloutContext, engine: EngineClient, prompt: Prompt, rids: list[str], request_fields: dict[str, str]
) -> list[Sample]:
    """One batch /generate of `prompt` once per rid on `engine` (`request_fields`, e.g. lora_path, apply to every
    item, as SGLang expands a single value over the batch), scored: one sample per rid, in rid order."""
    prompt_ids = ctx.tokenizer.first_turn_ids(prompt.messages, None, {})
    payload = {**_payload(ctx, [prompt_ids] * len(rids)), **request_fields, "rid": rids}
    results = await engine.generate(payload)
    if not isinstance(results, list) or len(results) != len(rids):
        raise ValueError(f"a batch /generate of {len(rids)} items was answered with {_count(results)}")
    return [_scored_sample(ctx, prompt, prompt_ids, result) for result in results]


async def generate_sample(
    ctx: RolloutContext, engine: EngineClient, prompt: Prompt, request_fields: dict[str, str]
) -> Sample:
    """One /generate of `prompt` on `engine` with `request_fields` (rid, and lora_path/extra_key when set), scored."""
    prompt_ids = ctx.tokenizer.first_turn_ids(prompt.messages, None, {})
    result = cast(dict[str, Any], await engine.generate({**_payload(ctx, prompt_ids), **request_fields}))  # one prompt
    return _scored_sample(ctx, prompt, prompt_ids, result)


def _payload(ctx: RolloutContext, input_ids: list[int] | list[list[int]]) -> dict[str, Any]:
    payload = {"input_ids": input_ids, "sampling_params": ctx.sampling_params(), "return_logprob": True}
    if ctx.routed_experts_layers is not None:
        payload["return_routed_experts"] = True
    return payload


def _count(results: Any) -> str:
    return f"{len(results)} results" if isinstance(results, list) else "a single result"


def _scored_sample(ctx: RolloutContext, prompt: Prompt, prompt_ids: list[int], result: dict[str, Any]) -> Sample:
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
