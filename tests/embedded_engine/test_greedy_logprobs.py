"""Temperature 0 is greedy, as in SGLang, on both sides of a run: the engine samples the argmax and
reports temperature-1.0 logprobs, and the trainer scores the same tokens at the same temperature. Otherwise a
run with rollout.temperature=0 would divide the trainer's logits by 0: NaN losses, a NaN adapter, then a 500 from the
engine sampling with it."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

PROMPT = [5, 6, 7, 8, 9, 10]


async def test_trainer_logprobs_at_temperature_zero_match_the_engines_greedy_logprobs(plain_client, tiny_dense_dir):
    from transformers import AutoModelForCausalLM

    from miles_runner.trainer.logprobs import TokenBatch, token_log_probs

    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = await plain_client.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    meta = reply.json()["meta_info"]
    engine = [entry[0] for entry in meta["input_token_logprobs"][1:]] + [e[0] for e in meta["output_token_logprobs"]]
    tokens = PROMPT + reply.json()["output_ids"]

    model = AutoModelForCausalLM.from_pretrained(tiny_dense_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokens])
    width = len(tokens) - 1
    batch = TokenBatch(ids, torch.ones_like(ids), torch.ones(1, width), torch.zeros(1, width), False)
    with torch.no_grad():
        trainer, _ = token_log_probs(model, batch, temperature=0.0)
    assert torch.isfinite(trainer).all()
    assert torch.allclose(trainer[0], torch.tensor(engine), atol=1e-4), (trainer[0].tolist(), engine)
