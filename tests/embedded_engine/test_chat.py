"""/v1/chat/completions: template, token-in, logprobs, meta_info, usage, metadata, streaming."""

from __future__ import annotations

import json

MESSAGES = [{"role": "user", "content": "What is 3 + 4?"}]
CHAT = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0}


async def chat(client, **body) -> dict:
    response = await client.post("/v1/chat/completions", json={**CHAT, **body})
    assert response.status_code == 200, response.text
    return response.json()


async def test_chat_applies_the_chat_template_with_generation_prompt(client, tiny_moe_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_dir)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    out = await chat(client, return_prompt_token_ids=True)
    assert out["choices"][0]["prompt_token_ids"] == expected
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")
    assert out["usage"]["prompt_tokens"] == len(expected)


async def test_chat_input_ids_bypass_the_template_and_match_generate(client):
    ids = [1, 322, 276, 201, 318, 283]
    out = await chat(client, input_ids=ids, return_token_ids=True)
    native = (
        await client.post(
            "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
        )
    ).json()
    assert out["choices"][0]["token_ids"] == native["output_ids"]
    assert out["choices"][0]["message"]["content"] == native["text"]


async def test_chat_meta_info_holds_native_logprob_triples(client):
    out = await chat(client, logprobs=True, return_meta_info=True, rid="chat-meta-1")
    choice = out["choices"][0]
    triples = choice["meta_info"]["output_token_logprobs"]
    assert len(triples) == choice["meta_info"]["completion_tokens"] == out["usage"]["completion_tokens"]
    assert all(isinstance(text, str) for _lp, _id, text in triples)
    assert [entry["logprob"] for entry in choice["logprobs"]["content"]] == [t[0] for t in triples]
    assert out["id"] == "chat-meta-1" == choice["meta_info"]["id"]


async def test_chat_response_has_usage_metadata_and_finish_reason(client):
    out = await chat(client)
    assert out["object"] == "chat.completion" and out["model"] == "default"
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]
    assert out["metadata"]["weight_version"] == (await client.get("/model_info")).json()["weight_version"]
    assert "sglext" not in out


async def test_chat_n_gives_n_choices(client):
    out = await chat(client, n=2, temperature=1.0, seed=3)
    assert [c["index"] for c in out["choices"]] == [0, 1]


async def test_chat_stream_deltas_add_up_to_the_full_answer_then_done(client):
    full = await chat(client)
    events = []
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == full["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
