"""The pure sampling functions on hand-built distributions."""

import pytest
import torch

from tierspec.sampling import SamplingConfig, logits_to_probs, residual_distribution


def test_greedy_is_one_hot_of_argmax():
    probs = logits_to_probs(torch.tensor([0.1, 3.0, -1.0]), SamplingConfig(0.0))
    assert probs.tolist() == [0.0, 1.0, 0.0]


def test_temperature_scales_logits():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=0.5))
    expected = torch.tensor([0.25, 0.0625, 0.0625]) / 0.375  # p^(1/T), renormalised
    assert torch.allclose(probs, expected, atol=1e-6)


def test_top_k_keeps_the_k_largest():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([0.0, 4 / 7, 3 / 7, 0.0]), atol=1e-6)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    # 0.4 + 0.3 = 0.7 >= 0.65: the nucleus is {1, 2}
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.65))
    assert torch.allclose(probs, torch.tensor([0.0, 4 / 7, 3 / 7, 0.0]), atol=1e-6)
    # 0.4 alone already reaches 0.4: only the top token survives
    probs = logits_to_probs(logits, SamplingConfig(temperature=1.0, top_p=0.4))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_residual_is_normalised_positive_part():
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual_distribution(q, p), torch.tensor([1.0, 0.0, 0.0]))
    # scaled (lossy β): max(0, q - 0.5 p) = [0.4, 0.0, 0.1]
    assert torch.allclose(residual_distribution(q, p, scale=0.5), torch.tensor([0.8, 0.0, 0.2]))


def test_residual_falls_back_to_target_when_empty():
    q = torch.tensor([0.5, 0.5])
    assert torch.equal(residual_distribution(q, q.clone()), q)


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)
