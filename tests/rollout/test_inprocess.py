"""In-process rollouts produce well-formed, rewarded samples in GRPO group order."""

import pytest
import torch

from miles_runner.plugins.lookup import get_reward, make_task
from miles_runner.rollout.inprocess import SamplingSettings, generate_samples

pytestmark = pytest.mark.integration


def _samples(model, tokenizer, task_name, reward_name, n_prompts, n, settings):
    task = make_task(task_name, seed=0)
    torch.manual_seed(0)
    prompts = [task.prompt(i) for i in range(n_prompts)]
    return prompts, generate_samples(model, tokenizer, task, prompts, n, get_reward(reward_name), settings)


def test_single_turn_samples_are_grouped_and_consistent(tiny_model, tokenizer):
    _, samples = _samples(tiny_model, tokenizer, "arith", "exact_match", 2, 3, SamplingSettings(6))
    assert [s.metadata["prompt_index"] for s in samples] == [0, 0, 0, 1, 1, 1]
    for s in samples:
        assert 0 < s.response_length <= 6
        assert s.loss_mask == [1] * s.response_length
        assert len(s.rollout_log_probs) == s.response_length
        assert all(lp <= 0 for lp in s.rollout_log_probs)
        assert s.reward in (0.0, 1.0)


def test_multi_turn_samples_mask_the_environment_turns(tiny_model, tokenizer):
    _, samples = _samples(tiny_model, tokenizer, "guess_number", "guess_number", 2, 2, SamplingSettings(4, max_turns=3))
    multi = [s for s in samples if s.metadata["turns"] > 1]
    assert multi, "an untrained model misses the number on its first try"
    for s in multi:
        response = tokenizer.decode(s.tokens[s.prompt_length :])
        assert "<|im_start|>user\n" in response
        env_tokens = [t for t, m in zip(s.tokens[s.prompt_length :], s.loss_mask, strict=True) if m == 0]
        assert "user" in tokenizer.decode(env_tokens)
        assert len(s.rollout_log_probs) == s.response_length


def test_rollout_log_probs_agree_with_a_full_forward(tiny_model, tiny_model_path, tokenizer):
    from miles_runner.trainer.logprobs import pack_samples, response_values, token_log_probs

    _, samples = _samples(tiny_model, tokenizer, "arith", "exact_match", 2, 2, SamplingSettings(6))
    with torch.no_grad():
        forward, _ = token_log_probs(tiny_model, pack_samples(samples, tokenizer.pad_token_id))
    for s, lp in zip(samples, response_values(forward, samples), strict=True):
        assert torch.allclose(torch.tensor(lp), torch.tensor(s.rollout_log_probs), atol=1e-4)
