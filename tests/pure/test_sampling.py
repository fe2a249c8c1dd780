"""The pure sampling functions on hand-built distributions."""

import pytest
import torch

from tierspec.sampling import (
    RESIDUAL,
    Noise,
    SamplingConfig,
    SeedError,
    gumbel_argmax,
    logits_to_probs,
    residual_distribution,
)


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


# ---- keyed noise --------------------------------------------------------------------------------

def test_noise_is_keyed_by_seed_position_and_purpose_not_by_the_draws_before():
    first, second = Noise(7, 50), Noise(7, 50)
    token_noise = first.gumbel(12)
    first.uniform(3)
    first.gumbel(12, RESIDUAL)
    second.gumbel(40)  # other draws first, in another order: the same bits
    second.uniform(12)
    assert torch.equal(second.gumbel(12), token_noise)
    assert second.uniform(3) == first.uniform(3)
    assert not torch.equal(first.gumbel(13), token_noise)  # another position
    assert not torch.equal(first.gumbel(12, RESIDUAL), token_noise)  # another purpose
    assert not torch.equal(Noise(8, 50).gumbel(12), token_noise)  # another seed
    # a block's position i is absolute position start + i
    assert torch.equal(first.block(10).gumbel(2), token_noise)
    assert torch.equal(first.block(10).shifted(1).gumbel(1), token_noise)
    assert torch.equal(first.block(11).gumbels(3)[1], token_noise)


def test_noise_of_committed_positions_is_dropped():
    noise = Noise(0, 10)
    kept = noise.gumbel(5).clone()
    noise.gumbel(6)
    noise.forget_before(6)
    assert sorted(noise._kept) == [6]
    assert torch.equal(noise.gumbel(5), kept)  # made again, the same


def test_token_noise_is_standard_gumbel_and_independent_across_keys():
    from scipy.stats import kstest

    noise = Noise(0, 1000)
    token = torch.stack([noise.gumbel(t) for t in range(200)]).double()  # 200,000 draws
    assert kstest(token.flatten().numpy(), "gumbel_r").pvalue > 1e-3
    residual = torch.stack([noise.gumbel(t, RESIDUAL) for t in range(200)]).double()
    pairs = [(token.flatten(), residual.flatten()), (token[:-1].flatten(), token[1:].flatten()),
             (token[:, :-1].flatten(), token[:, 1:].flatten())]
    for a, b in pairs:  # purposes, neighbouring positions, neighbouring tokens
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.01
    coins = torch.tensor([noise.uniform(t) for t in range(20000)])
    assert kstest(coins.numpy(), "uniform").pvalue > 1e-3


def test_the_perturbed_argmax_never_picks_a_token_of_probability_zero():
    probs = torch.tensor([0.0, 0.7, 0.0, 0.3])
    picks = {int(gumbel_argmax(probs, Noise(seed, 4).gumbel(0))) for seed in range(200)}
    assert picks == {1, 3}
    # rows at once: [2, V] with [2, V] noise
    rows = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert gumbel_argmax(rows, Noise(1, 4).block(0).gumbels(2)).tolist() == [1, 3]


@pytest.mark.parametrize("bad", ["7", 1.5, True])
def test_a_seed_must_be_an_integer(bad):
    with pytest.raises(SeedError, match="must be an integer"):
        Noise(bad, 4)
