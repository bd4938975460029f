"""The OpenAI chat endpoint: meta info and weight version, `model` suffixes that select an adapter, routed
experts.
"""

from __future__ import annotations

from typing import Any

from miles_runner.sglang_client import response as res
from miles_runner.sglang_client.routed_experts import decode_routed_experts
from miles_testkit.contract.base import PROMPT, ContractTarget, contract_check
from miles_testkit.contract.helpers import expect

CHAT_MESSAGES = [{"role": "user", "content": PROMPT}]


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": "default", "messages": CHAT_MESSAGES, "max_tokens": 8, "temperature": 0.0, **fields}


@contract_check
async def chat_completion_returns_meta_info_and_weight_version(target: ContractTarget) -> dict[str, Any]:
    reply = await target.client.chat_completions(chat_body(logprobs=True, return_meta_info=True))
    choice = reply["choices"][0]
    expect(isinstance(choice["message"]["content"], str), "message.content is not a string")
    tokens, _ = res.output_token_logprobs(choice)
    expect(len(tokens) == reply["usage"]["completion_tokens"], "meta_info logprobs differ from usage")
    version = await target.client.weight_version()
    expect(reply.get("metadata", {}).get("weight_version") == version, "metadata.weight_version missing")
    return {"finish_reason": choice["finish_reason"]}


@contract_check
async def chat_model_suffix_selects_the_adapter(target: ContractTarget) -> dict[str, Any]:
    def logprobs(reply: dict[str, Any]) -> list[float]:
        return res.output_token_logprobs(reply["choices"][0])[1]

    body = chat_body(logprobs=True, return_meta_info=True)
    base = logprobs(await target.client.chat_completions(body))
    suffix = logprobs(await target.client.chat_completions({**body, "model": f"default:{target.adapter_name}"}))
    field = logprobs(await target.client.chat_completions({**body, "lora_path": target.adapter_name}))
    expect(target.same_logprobs(suffix, field), "model 'base:adapter' and lora_path disagree")
    expect(not target.same_logprobs(suffix, base), "model 'base:adapter' did not apply the adapter")
    return {}


@contract_check
async def chat_routed_experts_decode(target: ContractTarget) -> dict[str, Any]:
    reply = await target.client.chat_completions(chat_body(return_routed_experts=True))
    payload = res.chat_routed_experts_payload(reply)
    expect(payload is not None, "no routed_experts in the chat response")
    usage = reply["usage"]
    rows = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    experts = decode_routed_experts(payload, rows, target.num_layers)
    expect(experts.shape[2] == target.top_k, f"top_k {experts.shape[2]}, expected {target.top_k}")
    return {"shape": list(experts.shape)}
