"""The advantage estimators on hand-computed cases (miles' formulas, written out step by step)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles_runner.config.schema import AlgorithmConfig
from miles_runner.procs.ports import LOOPBACK, free_port
from miles_runner.trainer.advantages import (
    Estimator,
    discounted_returns,
    last_token,
    loss_kl_coef,
    masked_whiten,
    sequence_ratio,
)
from miles_runner.trainer.loss import PolicyLossConfig, policy_loss

pytestmark = pytest.mark.integration


def whitened(values: list[float]) -> list[float]:
    """(x - mean) / unbiased std: the statistics written out by hand."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


def test_grpo_and_gspo_give_one_group_normalised_value_per_sample():
    rewards = torch.tensor([1.0, 0.0, 2.0, 4.0])
    for name in ("grpo", "gspo"):
        adv = Estimator(name, group_size=2).advantages(rewards, [3, 0], torch.ones(2, 3), torch.ones(2, 3))
        # group [2, 4]: mean 3, std sqrt(2); group [1, 0]: mean 0.5, std sqrt(0.5)
        assert adv.tolist() == pytest.approx([1 / math.sqrt(2), 0.5 / math.sqrt(0.5)], rel=1e-5)


def test_reinforce_plus_plus_discounts_kl_penalised_token_rewards_then_whitens():
    # Row 0: prompt at column 0, response at 1-3, padding at 4; row 1: response at 1-2, padding at 3-4.
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float)
    valid = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], dtype=torch.float)
    kl = torch.tensor([[0.5, 1.0, 2.0, 0.0, 9.9], [0.3, 1.0, 3.0, 7.0, 9.9]])  # padding KL must not count
    estimator = Estimator("reinforce_plus_plus", group_size=2, kl_coef=0.1, gamma=0.5)
    adv = estimator.advantages(torch.tensor([1.0, 0.0]), [0, 1], mask, valid, kl)
    # token rewards r = -0.1 * KL, plus the reward on the last trained token:
    #   row 0: [-0.05, -0.1, -0.2, 0 + 1.0, 0]      row 1: [-0.03, -0.1, -0.3 + 0.0, 0, 0]
    # returns G_t = r_t + 0.5 G_{t+1} on the trained tokens:
    #   row 0: G3 = 1.0, G2 = -0.2 + 0.5 = 0.3, G1 = -0.1 + 0.15 = 0.05
    #   row 1: G2 = -0.3, G1 = -0.1 - 0.15 = -0.25
    expected = whitened([0.05, 0.3, 1.0, -0.25, -0.3])  # mean 0.16, unbiased var 0.27925
    assert [adv[0, 1], adv[0, 2], adv[0, 3], adv[1, 1], adv[1, 2]] == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx([-0.20816, 0.26493, 1.58958, -0.77587, -0.87048], abs=1e-5)


def test_reinforce_plus_plus_without_kl_and_discount_gives_every_token_the_reward():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = Estimator("reinforce_plus_plus", group_size=2).advantages(
        torch.tensor([1.0, 0.0]), [0, 1], mask, torch.ones(2, 2)
    )
    # returns [1, 1] and [0]: mean 2/3, unbiased std sqrt(1/3)
    assert [adv[0, 0], adv[0, 1], adv[1, 0]] == pytest.approx([0.57735, 0.57735, -1.15470], abs=1e-5)


def test_reinforce_plus_plus_uses_the_raw_reward_not_the_group_baseline():
    mask = torch.ones(2, 1)
    same = Estimator("reinforce_plus_plus", group_size=2).advantages(torch.tensor([3.0, 3.0]), [0, 1], mask, mask)
    # equal rewards whiten to 0 either way; the variance guard keeps them finite
    assert same.tolist() == [[0.0], [0.0]]


def test_reinforce_plus_plus_baseline_subtracts_the_group_mean_and_the_kl_penalty_then_whitens():
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    adv = Estimator("reinforce_plus_plus_baseline", group_size=2, kl_coef=0.2).advantages(
        torch.tensor([1.0, 0.0]), [0, 1], mask, mask, kl
    )
    # baselines 1 - 0.5 = 0.5 and 0 - 0.5 = -0.5; minus 0.2 * KL: [0.5, 0.3] and [-0.6, -0.5]
    expected = whitened([0.5, 0.3, -0.6, -0.5])  # mean -0.075, unbiased var 0.30917
    assert adv.flatten().tolist() == pytest.approx(expected, rel=1e-5)
    assert expected == pytest.approx([1.03412, 0.67443, -0.94420, -0.76435], abs=1e-5)


def test_reinforce_estimators_with_kl_need_the_kl():
    estimator = Estimator("reinforce_plus_plus", group_size=1, kl_coef=0.1)
    with pytest.raises(ValueError, match="per-token KL"):
        estimator.advantages(torch.tensor([1.0]), [0], torch.ones(1, 2), torch.ones(1, 2))


def test_ppo_is_not_an_estimator_the_trainers_build():
    with pytest.raises(ValueError, match="'ppo' is not built"):
        Estimator("ppo", group_size=2)


def test_the_kl_is_a_loss_term_only_where_it_is_not_in_the_reward():
    cases = {"grpo": 0.1, "gspo": 0.1, "reinforce_plus_plus": 0.0, "reinforce_plus_plus_baseline": 0.0}
    for name, in_loss in cases.items():
        algorithm = AlgorithmConfig(advantage_estimator=name, kl_coef=0.1)
        assert loss_kl_coef(algorithm) == in_loss
        assert sequence_ratio(algorithm) == (name == "gspo")


def test_discounted_returns_accumulate_from_the_end():
    returns = discounted_returns(torch.tensor([[1.0, 2.0, 4.0]]), gamma=0.5)
    assert returns.tolist() == [[1.0 + 0.5 * (2.0 + 0.5 * 4.0), 2.0 + 0.5 * 4.0, 4.0]]


def test_last_token_marks_the_last_trained_position_even_after_masked_observation_tokens():
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    assert last_token(mask).tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]


def test_a_sample_without_trained_tokens_cannot_carry_its_reward():
    with pytest.raises(ValueError, match="no trained token"):
        last_token(torch.tensor([[0.0, 0.0]]))


def test_whitening_uses_only_masked_values():
    values = torch.tensor([[1.0, 100.0], [3.0, -50.0]])
    out = masked_whiten(values, torch.tensor([[1.0, 0.0], [1.0, 0.0]]))
    assert [out[0, 0].item(), out[1, 0].item()] == pytest.approx(whitened([1.0, 3.0]), rel=1e-5)


def test_gspo_shares_one_sequence_ratio_over_the_samples_tokens():
    config = PolicyLossConfig(eps_clip=10.0, eps_clip_high=10.0, sequence_ratio=True)
    log_probs = torch.tensor([[math.log(2.0), 0.0, 7.0]], requires_grad=True)  # the third token is masked
    out = policy_loss(log_probs, torch.zeros(1, 3), torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]), config)
    out.loss.backward()
    # mean log-ratio over the trained tokens: log(2) / 2, so the ratio is sqrt(2) on both
    assert out.loss.item() == pytest.approx(-math.sqrt(2))
    assert out.metrics["ratio_mean"] == pytest.approx(math.sqrt(2))
    # d(-sqrt(2) ...)/d log p_t = -ratio / 2 for each trained token; nothing for the masked one
    assert log_probs.grad[0].tolist() == pytest.approx([-math.sqrt(2) / 2, -math.sqrt(2) / 2, 0.0])


def test_gspo_clips_the_sequence_ratio():
    config = PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28, sequence_ratio=True)
    log_probs = torch.tensor([[math.log(2.0), 0.0]], requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), config)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.28)
    assert out.metrics["clip_fraction"] == 1.0
    assert log_probs.grad.abs().sum().item() == 0.0


def test_whitening_over_two_gloo_ranks_uses_the_statistics_of_both(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("whiten_worker.py")), str(tmp_path)],
            env={
                **os.environ,
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "OMP_NUM_THREADS": "1",
            },
        )
        for rank in range(2)
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    rank0, rank1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    expected = whitened([1.0, 3.0, 5.0])  # the trained tokens of both ranks
    assert [rank0[0, 0].item(), rank0[0, 1].item(), rank1[0, 0].item()] == pytest.approx(expected, rel=1e-5)
