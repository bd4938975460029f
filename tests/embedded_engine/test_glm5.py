"""The embedded engine serves GLM-5's architecture (tiny-glm5: MLA attention whose cache is a latent and a rope key,
a DSA indexer with a key cache of its own, a dense first layer, then routed experts): greedy tokens as transformers'
own generate gives them, alone and in a ragged batch; prefix-cache hits that answer as a cold prefill; LoRA on the MLA
linears as peft computes it; and the routers' expert choices (R3)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from miles_runner.embedded_engine.lora_registry import serialize_lora_tensors
from miles_runner.sglang_client.routed_experts import decode_routed_experts

from .conftest import MAX_LORA_RANK
from .server_process import EngineProcess, start_engine

pytestmark = pytest.mark.integration

PROMPTS = [[5, 6, 7, 8, 9], [(7 * i) % 300 + 5 for i in range(12)], [(11 * i) % 350 + 3 for i in range(21)]]
LONG = [(7 * i) % 300 + 5 for i in range(40)]  # longer than the prefix cache's block of 16 tokens
NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
LAYERS, TOPK, EXPERTS = 2, 2, 4  # tiny-glm5: layer 0 dense, layer 1 routed (core/tiny_shapes.py)


@pytest.fixture(scope="module")
def glm5_engine(tiny_glm5_dir: Path, glm5_adapter_dir: Path, tmp_path_factory) -> Iterator[EngineProcess]:
    process = start_engine(
        tiny_glm5_dir,
        tmp_path_factory.mktemp("glm5") / "engine.log",
        "--enable-lora",
        "--lora-paths",
        f"mla={glm5_adapter_dir}",
        "--max-lora-rank",
        str(MAX_LORA_RANK),
        "--enable-return-routed-experts",
    )
    yield process
    process.stop()


@pytest.fixture()
async def glm5(glm5_engine: EngineProcess) -> httpx.AsyncClient:
    async with httpx.AsyncClient(base_url=glm5_engine.url, timeout=60.0) as http:
        yield http


@pytest.fixture(scope="module")
def hf_model(tiny_glm5_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_glm5_dir, dtype=torch.float32).eval()


async def generate(client: httpx.AsyncClient, input_ids, **body) -> dict | list:
    reply = await client.post("/generate", json={"input_ids": input_ids, "sampling_params": GREEDY, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def output_logprobs(out: dict) -> list[float]:
    return [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]


def prompt_logprobs(out: dict) -> list[float]:
    """The logprobs of the prompt tokens after the first asked position (whose entry has none)."""
    entries = out["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None
    return [entry[0] for entry in entries[1:]]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' own greedy generation, never stopping early (the engine's ignore_eos)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=[],
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def token_logprobs(model, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()
    chosen = torch.tensor(tokens[1:])[:, None]
    return logits.log_softmax(-1).gather(-1, chosen).squeeze(-1).tolist()


async def test_greedy_tokens_are_transformers_generate_tokens(glm5, hf_model):
    alone = await generate(glm5, PROMPTS[1])
    want = hf_greedy(hf_model, PROMPTS[1])
    assert len(want) == NEW_TOKENS and alone["output_ids"] == want


async def test_a_ragged_batch_gives_every_prompt_its_own_greedy_tokens(glm5, hf_model):
    """Prompts of 5, 12 and 21 tokens prefill and decode together: left-padded latents, rope keys and indexer keys."""
    await glm5.post("/flush_cache")
    batch = await generate(glm5, PROMPTS)
    assert [item["output_ids"] for item in batch] == [hf_greedy(hf_model, prompt) for prompt in PROMPTS]


async def test_a_ragged_batch_gives_every_prompt_its_own_logprobs_and_routes(glm5):
    """What the trainer replays (R3) and compares (the rollout's logprobs) must not depend on the batch."""
    await glm5.post("/flush_cache")
    asked = {"return_logprob": True, "return_routed_experts": True, "logprob_start_len": 0}
    batch = await generate(glm5, PROMPTS, **asked)
    for prompt, item in zip(PROMPTS, batch, strict=True):
        await glm5.post("/flush_cache")
        alone = await generate(glm5, prompt, **asked)
        assert output_logprobs(item) == pytest.approx(output_logprobs(alone), abs=1e-5)
        assert prompt_logprobs(item) == pytest.approx(prompt_logprobs(alone), abs=1e-5)
        rows = len(prompt) + NEW_TOKENS - 1
        routes = [decode_routed_experts(x["meta_info"]["routed_experts"], rows, LAYERS) for x in (item, alone)]
        assert routes[0].shape == (rows, LAYERS, TOPK)
        assert np.array_equal(np.sort(routes[0], axis=-1), np.sort(routes[1], axis=-1))


async def test_a_prefix_cache_hit_answers_as_a_cold_prefill(glm5):
    await glm5.post("/flush_cache")
    first = await generate(glm5, LONG)
    turn = LONG + first["output_ids"] + [11, 12, 13, 14, 15, 16]
    asked = {"return_logprob": True, "return_routed_experts": True}
    cached = await generate(glm5, turn, **asked)
    assert cached["meta_info"]["cached_tokens"] == len(LONG) + NEW_TOKENS - 1
    await glm5.post("/flush_cache")
    cold = await generate(glm5, turn, **asked)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cached["output_ids"] == cold["output_ids"]
    assert output_logprobs(cached) == pytest.approx(output_logprobs(cold), abs=1e-5)
    rows = len(turn) + NEW_TOKENS - 1
    routed = [decode_routed_experts(r["meta_info"]["routed_experts"], rows, LAYERS) for r in (cached, cold)]
    assert np.array_equal(routed[0], routed[1])


async def test_prompt_logprobs_after_a_cached_prefix_equal_a_cold_prefills(glm5):
    await glm5.post("/flush_cache")
    await generate(glm5, LONG)
    turn = [*LONG, 9, 8, 7, 6]
    asked = {"return_logprob": True, "logprob_start_len": 32}
    cached = await generate(glm5, turn, **asked)
    assert cached["meta_info"]["cached_tokens"] == 32
    await glm5.post("/flush_cache")
    cold = await generate(glm5, turn, **asked)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert prompt_logprobs(cached) == pytest.approx(prompt_logprobs(cold), abs=1e-5)


async def test_an_mla_adapter_changes_the_output_as_peft_computes_it(glm5, tiny_glm5_dir, glm5_adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = PROMPTS[2]
    asked = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True}
    adapted = prompt_logprobs(await generate(glm5, tokens, lora_path="mla", logprob_start_len=0, **asked))
    base = prompt_logprobs(await generate(glm5, tokens, logprob_start_len=0, **asked))
    model = AutoModelForCausalLM.from_pretrained(tiny_glm5_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, glm5_adapter_dir).eval()
    assert adapted == pytest.approx(token_logprobs(peft_model, tokens), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(adapted, base, strict=True)) > 1e-3


async def test_an_mla_adapter_and_the_base_share_a_batch(glm5):
    batch = await generate(glm5, [PROMPTS[1]] * 2, lora_path=[None, "mla"], return_logprob=True)
    for item, adapter in zip(batch, [None, "mla"], strict=True):
        alone = await generate(glm5, PROMPTS[1], lora_path=adapter, return_logprob=True)
        assert item["output_ids"] == alone["output_ids"]
        assert output_logprobs(item) == pytest.approx(output_logprobs(alone), abs=1e-5)


async def test_an_mla_adapter_loaded_from_tensors_equals_it_loaded_from_disk(glm5, glm5_adapter_dir):
    """The weight sync's path: the trainer sends the adapter's tensors, not a folder."""
    from safetensors.torch import load_file

    body = {
        "lora_name": "mla_tensors",
        "config_dict": json.loads((glm5_adapter_dir / "adapter_config.json").read_text()),
        "serialized_named_tensors": [serialize_lora_tensors(load_file(glm5_adapter_dir / "adapter_model.safetensors"))],
    }
    reply = await glm5.post("/load_lora_adapter_from_tensors", json=body)
    assert reply.status_code == 200, reply.text
    try:
        from_tensors = await generate(glm5, PROMPTS[1], lora_path="mla_tensors", return_logprob=True)
        from_disk = await generate(glm5, PROMPTS[1], lora_path="mla", return_logprob=True)
        assert output_logprobs(from_tensors) == pytest.approx(output_logprobs(from_disk), abs=1e-5)
    finally:
        await glm5.post("/unload_lora_adapter", json={"lora_name": "mla_tensors"})


async def test_routed_experts_are_the_glm_routers_choices(glm5, hf_model):
    out = await generate(glm5, PROMPTS[1], return_routed_experts=True)
    tokens = PROMPTS[1] + out["output_ids"]
    rows = len(tokens) - 1  # every token that went through a forward
    routing = decode_routed_experts(out["meta_info"]["routed_experts"], rows, LAYERS)
    assert routing.shape == (rows, LAYERS, TOPK)
    assert not routing[:, 0].any()  # the dense first layer routes nothing: zeros, as SGLang's buffer
    assert routing[:, 1].min() >= 0 and routing[:, 1].max() < EXPERTS
    captured = {}
    gate = hf_model.model.layers[1].mlp.gate
    handle = gate.register_forward_hook(lambda _m, _i, output: captured.__setitem__("ids", output[2]))
    try:
        with torch.no_grad():
            hf_model(torch.tensor([tokens[:-1]]))
    finally:
        handle.remove()
    assert np.array_equal(routing[:, 1], captured["ids"].numpy())


def test_a_context_past_the_indexers_top_k_is_refused_at_start(tiny_glm5_dir, tiny_moe_dir):
    from transformers import AutoConfig

    from miles_runner.embedded_engine.engine import check_dsa_context

    config = AutoConfig.from_pretrained(tiny_glm5_dir)
    check_dsa_context(config, config.index_topk)  # every key kept: served
    with pytest.raises(ValueError, match=f"--context-length {config.index_topk}$"):
        check_dsa_context(config, config.index_topk + 1)
    check_dsa_context(AutoConfig.from_pretrained(tiny_moe_dir), 1 << 20)  # no indexer
