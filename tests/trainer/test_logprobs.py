"""Packing samples and aligning per-token log-probs with response tokens."""

import pytest
import torch

from miles_runner.session.samples import Sample, SampleStatus
from miles_runner.trainer.logprobs import pack_samples, response_values


def sample(tokens, response_length, loss_mask=None, log_probs=None):
    return Sample(
        tokens,
        response_length,
        loss_mask or [1] * response_length,
        log_probs or [],
        None,
        SampleStatus.COMPLETED,
        reward=0.0,
    )


def test_loss_mask_sits_on_the_columns_that_predict_response_tokens():
    batch = pack_samples([sample([5, 6, 7, 8], 2, [1, 0]), sample([5, 9], 1)], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 0], [1, 0, 0]]  # column t predicts input_ids[:, t + 1]


def test_rollout_log_probs_land_on_the_same_columns_and_read_back():
    samples = [sample([5, 6, 7, 8], 2, log_probs=[-0.5, -1.5]), sample([5, 9], 1, log_probs=[-2.0])]
    batch = pack_samples(samples, pad_id=0)
    assert batch.rollout_log_probs.tolist() == [[0.0, -0.5, -1.5], [-2.0, 0.0, 0.0]]
    assert response_values(batch.rollout_log_probs, samples) == [[-0.5, -1.5], [-2.0]]


@pytest.mark.parametrize("bad", [sample([1, 2], 2), sample([1, 2, 3], 1, loss_mask=[1, 1])])
def test_inconsistent_samples_are_rejected(bad):
    with pytest.raises(ValueError):
        pack_samples([bad], pad_id=0)


def test_response_values_reads_each_samples_response_span():
    values = torch.arange(6, dtype=torch.float).view(2, 3)
    assert response_values(values, [sample([1, 2, 3, 4], 3), sample([1, 2, 3], 1)]) == [[0.0, 1.0, 2.0], [4.0]]
