"""/generate: inputs, sampling, logprobs, stop handling, batches, n, streaming."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.integration

GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
PROMPT_IDS = [5, 6, 7, 8, 9, 10]


async def generate(client: httpx.AsyncClient, **body) -> dict | list:
    response = await client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_greedy_generation_is_deterministic(client):
    first = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY)
    second = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY)
    assert first["output_ids"] == second["output_ids"]
    assert len(first["output_ids"]) == 12


async def test_max_new_tokens_gives_a_length_finish(client):
    out = await generate(client, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "max_new_tokens": 5})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert out["meta_info"]["completion_tokens"] == 5
    assert out["meta_info"]["prompt_tokens"] == len(PROMPT_IDS)


async def test_same_sampling_seed_repeats_and_another_seed_differs(client):
    params = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11}
    first = await generate(client, input_ids=PROMPT_IDS, sampling_params=params)
    again = await generate(client, input_ids=PROMPT_IDS, sampling_params=params)
    other = await generate(client, input_ids=PROMPT_IDS, sampling_params={**params, "sampling_seed": 12})
    assert first["output_ids"] == again["output_ids"]
    assert first["output_ids"] != other["output_ids"]


async def test_text_prompt_equals_its_input_ids(client, tiny_moe_dir):
    from transformers import AutoTokenizer

    text = "What is 3 + 4?"
    ids = AutoTokenizer.from_pretrained(tiny_moe_dir)(text)["input_ids"]
    by_text = await generate(client, text=text, sampling_params=GREEDY)
    by_ids = await generate(client, input_ids=ids, sampling_params=GREEDY)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)


async def test_output_logprobs_are_the_models_aligned_with_output_ids(client, tiny_moe_dir):
    import torch
    from transformers import AutoModelForCausalLM

    out = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY, return_logprob=True)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT_IDS + out["output_ids"]])).logits[0]
    expected = torch.log_softmax(logits, dim=-1)
    for offset, (logprob, token_id, _text) in enumerate(triples):
        assert logprob == pytest.approx(float(expected[len(PROMPT_IDS) - 1 + offset, token_id]), abs=1e-4)


async def test_input_logprobs_start_at_logprob_start_len_with_a_null_first_entry(client):
    out = await generate(
        client,
        input_ids=PROMPT_IDS,
        sampling_params={**GREEDY, "max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=2,
        return_text_in_logprobs=True,
    )
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROMPT_IDS[2:]
    assert entries[0][0] is None
    assert all(isinstance(e[0], float) and e[0] <= 0 for e in entries[1:])
    assert all(isinstance(e[2], str) for e in entries)


async def test_top_logprobs_give_k_alternatives_per_position(client):
    out = await generate(
        client,
        input_ids=PROMPT_IDS,
        sampling_params={**GREEDY, "max_new_tokens": 3},
        return_logprob=True,
        top_logprobs_num=3,
    )
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == 3 and all(len(position) == 3 for position in tops)
    # Greedy: the chosen token is the most likely one.
    assert [position[0][1] for position in tops] == out["output_ids"]


async def test_stop_token_id_stops_and_is_trimmed_from_text(client):
    free = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY)
    stop_id = free["output_ids"][3]
    first_hit = free["output_ids"].index(stop_id)
    out = await generate(client, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "stop_token_ids": [stop_id]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == free["output_ids"][: first_hit + 1]
    kept = await generate(
        client, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "stop_token_ids": [stop_id], "no_stop_trim": True}
    )
    assert kept["text"].startswith(out["text"]) and len(kept["text"]) > len(out["text"])


async def test_stop_string_stops_and_is_trimmed_unless_no_stop_trim(client):
    free = await generate(client, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "max_new_tokens": 24})
    stop = free["text"][6:8]
    out = await generate(client, input_ids=PROMPT_IDS, sampling_params={**GREEDY, "max_new_tokens": 24, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"] and free["text"].startswith(out["text"])
    kept = await generate(
        client,
        input_ids=PROMPT_IDS,
        sampling_params={**GREEDY, "max_new_tokens": 24, "stop": [stop], "no_stop_trim": True},
    )
    assert stop in kept["text"]


async def test_batch_returns_items_in_input_order_with_indexed_rids(client):
    prompts = [PROMPT_IDS, [11, 12, 13], [20, 21]]
    batch = await generate(client, input_ids=prompts, sampling_params=GREEDY, rid="batchrid")
    singles = [await generate(client, input_ids=p, sampling_params=GREEDY) for p in prompts]
    assert [item["output_ids"] for item in batch] == [s["output_ids"] for s in singles]
    assert [item["meta_info"]["id"] for item in batch] == ["batchrid_0", "batchrid_1", "batchrid_2"]


async def test_n_samples_come_back_as_an_adjacent_list(client):
    out = await generate(
        client, input_ids=PROMPT_IDS, sampling_params={"max_new_tokens": 16, "temperature": 1.0, "n": 3}
    )
    assert isinstance(out, list) and len(out) == 3
    assert len({tuple(item["output_ids"]) for item in out}) > 1


async def test_concurrent_requests_give_the_same_greedy_tokens_as_alone(client):
    prompts = [[i, i + 1, i + 2] for i in range(30, 38)]
    alone = [await generate(client, input_ids=p, sampling_params=GREEDY) for p in prompts]
    together = await asyncio.gather(*(generate(client, input_ids=p, sampling_params=GREEDY) for p in prompts))
    assert [t["output_ids"] for t in together] == [a["output_ids"] for a in alone]


async def test_stream_sends_cumulative_chunks_then_done(client):
    events = []
    body = {"input_ids": PROMPT_IDS, "sampling_params": GREEDY, "stream": True}
    async with client.stream("POST", "/generate", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 12
    full = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY)
    assert chunks[-1]["output_ids"] == full["output_ids"]


async def test_meta_info_carries_the_weight_version_and_rid(client):
    out = await generate(client, input_ids=PROMPT_IDS, sampling_params=GREEDY, rid="my-rid-1")
    info = (await client.get("/model_info")).json()
    assert out["meta_info"]["id"] == "my-rid-1"
    assert out["meta_info"]["weight_version"] == info["weight_version"]


async def test_a_batch_of_one_prompt_gives_each_item_what_a_single_request_with_its_seed_gives(client):
    """The single-turn rollout's group request (rollout/single_turn.py): the prompt once per sample in one batch,
    sampled; per item the tokens, logprobs and routed experts of a request of its own."""
    seeded = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 40 + k} for k in range(4)]
    fields = {"return_logprob": True, "return_routed_experts": True}
    rids = [f"g-s{k}" for k in range(4)]
    batch = await generate(client, input_ids=[PROMPT_IDS] * 4, sampling_params=seeded, rid=rids, **fields)
    singles = [await generate(client, input_ids=PROMPT_IDS, sampling_params=params, **fields) for params in seeded]
    assert [item["meta_info"]["id"] for item in batch] == rids
    assert [item["output_ids"] for item in batch] == [single["output_ids"] for single in singles]
    assert len({tuple(item["output_ids"]) for item in batch}) > 1  # sampled: the seeds matter
    for item, single in zip(batch, singles, strict=True):
        mine, alone = item["meta_info"], single["meta_info"]
        assert [t[1] for t in mine["output_token_logprobs"]] == [t[1] for t in alone["output_token_logprobs"]]
        assert [t[0] for t in mine["output_token_logprobs"]] == pytest.approx(
            [t[0] for t in alone["output_token_logprobs"]], abs=1e-5
        )
        assert mine["routed_experts"] == alone["routed_experts"]
