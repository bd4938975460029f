"""The policy loss and the GRPO group advantages on small hand-computed cases."""

import math

import pytest
import torch

from miles_runner.trainer.advantages import group_advantages
from miles_runner.trainer.loss import PolicyLossConfig, k3_kl, masked_reduce, policy_loss

NO_CLIP = PolicyLossConfig(eps_clip=10.0, eps_clip_high=10.0)


def test_group_advantages_subtract_group_mean_without_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 4.0]), group_size=3, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2.0, 0.0, 2.0]))


def test_group_advantages_divide_by_unbiased_group_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 2.0, 4.0]), group_size=2, normalize_std=True)
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); group [2, 4]: mean 3, std sqrt(2)
    expected = torch.tensor([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), -1 / math.sqrt(2), 1 / math.sqrt(2)])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_group_advantages_are_zero_for_a_constant_group_with_std():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0]), group_size=3, normalize_std=True)
    assert torch.equal(adv, torch.zeros(3))


@pytest.mark.parametrize("normalize_std", [True, False])
def test_group_of_one_has_zero_advantage(normalize_std):
    adv = group_advantages(torch.tensor([0.3, 1.0]), group_size=1, normalize_std=normalize_std)
    assert torch.equal(adv, torch.zeros(2))


def test_group_advantages_reject_a_partial_group():
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(torch.zeros(4), group_size=3, normalize_std=False)


def test_on_policy_loss_is_minus_mean_advantage_and_its_gradient_is_minus_advantage():
    log_probs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = policy_loss(log_probs, log_probs.detach(), torch.tensor([0.5]), torch.ones(1, 2), PolicyLossConfig())
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.5)
    assert torch.allclose(log_probs.grad, torch.tensor([[-0.25, -0.25]]))  # d/dlogp of -ratio*A, mean of 2
    assert out.metrics["ratio_mean"] == pytest.approx(1.0)
    assert out.metrics["clip_fraction"] == 0.0


def test_ratio_above_upper_clip_is_clipped_for_positive_advantage():
    config = PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28)
    log_probs = torch.tensor([[math.log(1.5)]], requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), config)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.28)
    assert log_probs.grad.item() == 0.0  # clipped: no gradient pushes the ratio further up
    assert out.metrics["clip_fraction"] == 1.0


def test_ratio_below_lower_clip_is_clipped_for_negative_advantage():
    config = PolicyLossConfig(eps_clip=0.2, eps_clip_high=0.28)
    log_probs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), config)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(0.8)
    assert log_probs.grad.item() == 0.0
    assert out.metrics["clip_fraction"] == 1.0


def test_clip_is_inactive_when_it_would_not_lower_the_objective():
    # ratio 0.5 with positive advantage: the unclipped term is the pessimistic one and keeps its gradient.
    log_probs = torch.tensor([[math.log(0.5)]], requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), PolicyLossConfig())
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-0.5)
    assert log_probs.grad.item() == pytest.approx(-0.5)
    assert out.metrics["clip_fraction"] == 0.0


def test_clip_is_asymmetric():
    config = PolicyLossConfig(eps_clip=0.1, eps_clip_high=0.5)
    log_probs = torch.tensor([[math.log(1.3)]])
    out = policy_loss(log_probs, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), config)
    assert out.loss.item() == pytest.approx(-1.3)  # inside the wider upper bound
    assert out.metrics["clip_fraction"] == 0.0


def test_masked_tokens_do_not_contribute():
    log_probs = torch.tensor([[0.0, 5.0]], requires_grad=True)
    out = policy_loss(log_probs, torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]), NO_CLIP)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert log_probs.grad[0, 1].item() == 0.0


def test_samples_are_averaged_per_sample_then_across_samples():
    values = torch.tensor([[1.0, 3.0, 0.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert masked_reduce(values, mask, per_token=False).item() == pytest.approx((2.0 + 10.0) / 2)
    assert masked_reduce(values, mask, per_token=True).item() == pytest.approx(14.0 / 3)


def test_normalizer_makes_micro_batches_add_up_to_the_global_mean():
    values = torch.tensor([[1.0], [2.0], [3.0], [6.0]])
    mask = torch.ones(4, 1)
    parts = masked_reduce(values[:2], mask[:2], False, normalizer=4) + masked_reduce(values[2:], mask[2:], False, 4)
    assert parts.item() == pytest.approx(masked_reduce(values, mask, per_token=False).item())


def test_per_token_advantages_are_accepted():
    log_probs = torch.zeros(1, 2)
    out = policy_loss(log_probs, log_probs, torch.tensor([[1.0, 3.0]]), torch.ones(1, 2), PolicyLossConfig())
    assert out.loss.item() == pytest.approx(-2.0)


def test_tis_weights_tokens_by_the_truncated_old_over_rollout_ratio():
    config = PolicyLossConfig(use_tis=True, tis_clip=2.0)
    log_probs = torch.zeros(1, 2)
    rollout = torch.tensor([[math.log(2.0), -math.log(4.0)]])  # weights 0.5 and min(4, 2) = 2
    out = policy_loss(log_probs, log_probs, torch.tensor([1.0]), torch.ones(1, 2), config, rollout_log_probs=rollout)
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    assert out.metrics["tis_mean"] == pytest.approx(1.25)


def test_tis_without_rollout_log_probs_is_an_error():
    with pytest.raises(ValueError, match="rollout_log_probs"):
        config = PolicyLossConfig(use_tis=True)
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), config)


def test_k3_kl_matches_its_formula_and_is_zero_at_the_reference():
    log_probs, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.5])
    kl = k3_kl(log_probs, ref)
    assert kl[0].item() == 0.0
    assert kl[1].item() == pytest.approx(math.exp(0.5) - 1 - 0.5)


def test_kl_penalty_adds_coefficient_times_kl_to_the_loss():
    config = PolicyLossConfig(kl_coef=0.1)
    log_probs = torch.tensor([[-2.0]])
    ref = torch.tensor([[-1.5]])
    out = policy_loss(log_probs, log_probs, torch.tensor([0.0]), torch.ones(1, 1), config, ref_log_probs=ref)
    expected_kl = math.exp(0.5) - 1.5
    assert out.metrics["kl"] == pytest.approx(expected_kl)
    assert out.loss.item() == pytest.approx(0.1 * expected_kl)


def test_entropy_bonus_lowers_the_loss():
    config = PolicyLossConfig(entropy_coef=0.01)
    log_probs = torch.zeros(1, 1)
    entropy = torch.tensor([[2.0]])
    out = policy_loss(log_probs, log_probs, torch.tensor([0.0]), torch.ones(1, 1), config, entropy=entropy)
    assert out.loss.item() == pytest.approx(-0.02)
    assert out.metrics["entropy"] == pytest.approx(2.0)
