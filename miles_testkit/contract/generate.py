"""Native /generate: aligned tokens and logprobs, batches in order, n samples, cumulative streams, routed
experts.
"""

from __future__ import annotations

import itertools
from typing import Any

from miles_runner.sglang_client import response as res
from miles_testkit.contract.base import PROMPT, ContractTarget, contract_check
from miles_testkit.contract.helpers import expect, generate_payload, greedy, rid


@contract_check
async def generate_text_returns_aligned_tokens_and_logprobs(target: ContractTarget) -> dict[str, Any]:
    request_id = rid("text")
    result = await target.client.generate(generate_payload(8, rid=request_id))
    info = res.meta_info(result)
    tokens, logprobs = res.output_token_logprobs(result)
    expect(tokens == result["output_ids"], "output_token_logprobs ids differ from output_ids")
    expect(len(tokens) == info["completion_tokens"] == 8, f"expected 8 tokens, got {len(tokens)}")
    expect(all(lp <= 0.0 for lp in logprobs), f"logprobs above 0: {logprobs}")
    expect(info["finish_reason"] == {"type": "length", "length": 8}, f"finish_reason {info['finish_reason']}")
    expect(info["id"] == request_id, f"meta_info.id {info['id']} is not the rid {request_id}")
    expect(info["prompt_tokens"] > 0 and isinstance(result["text"], str), "no prompt_tokens or text")
    again = await target.client.generate(generate_payload(8))
    expect(again["output_ids"] == tokens, "greedy generation is not deterministic")
    return {"prompt_tokens": info["prompt_tokens"], "weight_version": res.weight_version(result)}


@contract_check
async def generate_input_ids_batch_returns_list_in_order(target: ContractTarget) -> dict[str, Any]:
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rids = [rid("batch0"), rid("batch1")]
    results = await target.client.generate(
        {"input_ids": prompts, "sampling_params": greedy(4), "rid": rids, "return_logprob": True}
    )
    expect(isinstance(results, list) and len(results) == 2, f"expected a list of 2, got {type(results)}")
    for prompt, request_id, result in zip(prompts, rids, results, strict=True):
        expect(result["meta_info"]["id"] == request_id, "batch results are not in input order")
        expect(res.prompt_tokens(result, prompt) == len(prompt), "prompt_tokens differs from len(input_ids)")
        expect(len(result["output_ids"]) == 4, "a batch item did not generate 4 tokens")
    return {}


@contract_check
async def generate_n_samples_returns_n_results(target: ContractTarget) -> dict[str, Any]:
    sampling = {**greedy(6), "temperature": 1.0, "n": 3}
    results = await target.client.generate({"text": PROMPT, "sampling_params": sampling})
    expect(isinstance(results, list) and len(results) == 3, "n=3 did not return 3 results")
    return {"distinct_samples": len({tuple(r["output_ids"]) for r in results})}


@contract_check
async def generate_stream_chunks_are_cumulative(target: ContractTarget) -> dict[str, Any]:
    events = [event async for event in target.client.generate_stream(generate_payload(8))]
    ids = [event["output_ids"] for event in events]
    cumulative = all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(ids))
    expect(cumulative, "stream chunks are not cumulative")
    expect(all(res.finish_reason_type(e) is None for e in events[:-1]), "finish_reason set before the end")
    expect(res.finish_reason_type(events[-1]) == "length", "the last chunk has no finish_reason")
    final = await target.client.generate(generate_payload(8))
    expect(events[-1]["output_ids"] == final["output_ids"], "streamed result differs from non-streamed")
    return {"events": len(events)}


@contract_check
async def generate_routed_experts_have_one_row_per_forwarded_token(target: ContractTarget) -> dict[str, Any]:
    result = await target.client.generate(generate_payload(8, return_routed_experts=True))
    full = res.routed_experts(result, num_layers=target.num_layers)
    expect(full is not None, "no routed_experts in meta_info")
    rows = result["meta_info"]["prompt_tokens"] + 8 - 1
    expect(full.shape == (rows, target.num_layers, target.top_k), f"shape {full.shape}, expected {rows} rows")
    expect(int(full.min()) >= 0 and int(full.max()) < target.num_experts, "expert id out of range")
    start = 3
    tail = await target.client.generate(generate_payload(8, return_routed_experts=True, routed_experts_start_len=start))
    partial = res.routed_experts(tail, num_layers=target.num_layers, start_len=start)
    expect(partial is not None and (partial == full[start:]).all(), "routed_experts_start_len rows differ")
    return {"shape": list(full.shape)}
