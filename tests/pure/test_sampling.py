"""The pure sampling functions on hand-built distributions."""

import math

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


def _nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The code's nucleus alone: ``sampling_logits`` at temperature 1 with top-p only."""
    from tierspec.sampling import sampling_logits

    return sampling_logits(logits, SamplingConfig(1.0, top_p=top_p))


def _nucleus_reference(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a whole sort: logits largest first (equal ones by id: a stable sort), the
    softmax's mass summed in that order, a token dropped once the mass before it reaches top_p."""
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices
    probs = logits.softmax(-1).gather(-1, order)
    mass_before = probs.cumsum(-1) - probs
    drop = torch.zeros_like(mass_before, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def _nucleus_rows(seed: int) -> list[torch.Tensor]:
    """Rows of each kind ``nucleus`` meets: peaked and flat, a wide vocabulary, many equal logits,
    −inf (a top-k before it)."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for vocab, scale in [(7, 1.0), (100, 4.0), (1000, 0.3), (49152, 3.0), (49152, 12.0)]:
        row = torch.randn(2, vocab, generator=generator) * scale
        rows += [row, (row * 2).round() / 2]  # the second with many equal logits
        cut = row.clone()
        cut[:, : vocab // 2] = float("-inf")
        rows.append(cut)
    return rows


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999, 0.9999999])
def test_the_nucleus_is_the_whole_sorts_bit_for_bit(top_p):
    """Every row, whichever way its nucleus is found (the top candidates, the logit bins, the
    whole row), equals the sorted reference exactly, equal logits at the bound included."""
    for rows in _nucleus_rows(seed=int(top_p * 1e7)):
        assert torch.equal(_nucleus(rows, top_p), _nucleus_reference(rows, top_p))
    batch = torch.randn(2, 3, 500, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_nucleus(batch, top_p), _nucleus_reference(batch, top_p))  # leading dimensions kept


def test_the_nucleus_keeps_the_first_equal_logits_by_id_at_its_bound(monkeypatch):
    """Four equal logits straddle the bound: the nucleus holds two of them, the first two by id,
    whether the candidates saw all four, some, or the bins found them."""
    from tierspec import sampling

    row = torch.full((1, 300), -20.0)
    row[0, [250, 10, 120, 37]] = 0.0  # four equal likeliest tokens, ~0.25 of the mass each
    expected = torch.full((1, 300), float("-inf"))
    expected[0, [10, 37]] = 0.0
    for candidates in (64, 2, 3):  # all four in sight; two of them; three
        monkeypatch.setattr(sampling, "NUCLEUS_CANDIDATES", candidates)
        assert torch.equal(_nucleus(row, 0.4), expected)
        assert torch.equal(_nucleus(row, 0.4), _nucleus_reference(row, 0.4))


def test_each_way_of_finding_the_nucleus_is_taken(monkeypatch):
    """The planted rows reach each way: a narrow nucleus within the top candidates; a wide one
    among the bins' tokens; over the whole row where the bins hold less than top_p and the margin,
    and where they claimed enough but the running sum kept every candidate (a margin below
    nothing); a row of NaN is left as it is."""
    from tierspec import sampling

    generator = torch.Generator().manual_seed(2)
    flat, peaked, wide = torch.randn(1, 49152, generator=generator), torch.randn(1, 49152, generator=generator) * 40, \
        torch.randn(1, 49152, generator=generator) * 4
    cases = [(peaked, 0.9, None, "_top_ids", []), (wide, 0.9, None, "_binned_ids", "part"),
             (flat, 1 - 2 ** -24, None, "_binned_ids", [49152]), (wide, 0.9, -0.5, "_binned_ids", "part, then all")]
    real_sort = torch.sort
    for rows, top_p, margin, way, sorts in cases:
        taken, sorted_lengths = [], []
        with monkeypatch.context() as patch:
            for name in ("_top_ids", "_binned_ids"):
                real = getattr(sampling, name)
                patch.setattr(sampling, name, lambda *args, real=real, name=name: (taken.append(name), real(*args))[1])
            patch.setattr(torch, "sort", lambda x, *a, **k: (sorted_lengths.append(len(x)), real_sort(x, *a, **k))[1])
            if margin is not None:
                patch.setattr(sampling, "NUCLEUS_MARGIN", margin)
            got = _nucleus(rows, top_p)
        assert torch.equal(got, _nucleus_reference(rows, top_p)) and taken == [way]
        if sorts == "part":
            assert len(sorted_lengths) == 1 and 64 < sorted_lengths[0] < 49152 / 4
        elif sorts == "part, then all":
            assert len(sorted_lengths) == 2 and sorted_lengths[0] < 49152 / 4 and sorted_lengths[1] == 49152
        else:
            assert sorted_lengths == sorts
    assert _nucleus(torch.full((1, 10), float("nan")), 0.5).isnan().all()


def _top_k_reference(rows: torch.Tensor, k: int, top_p: float = 1.0) -> torch.Tensor:
    """Top-k as a mask below the k-th largest logit; then, with top_p, the nucleus of the tokens it
    kept: their softmax among themselves (in id order), largest first (equal ones by id)."""
    kth = torch.topk(rows, k, dim=-1).values[..., -1:]
    kept = rows.masked_fill(rows < kth, float("-inf"))
    if top_p >= 1.0:
        return kept
    out = torch.full_like(rows, float("-inf"))
    for row, source in zip(out, kept):
        survivors = torch.nonzero(source > float("-inf")).flatten()
        probs = source[survivors].softmax(-1)
        order = torch.sort(source[survivors], descending=True, stable=True).indices
        mass = probs[order]
        chosen = survivors[order[~(mass.cumsum(0) - mass >= top_p)]]
        row[chosen] = source[chosen]
    return out


@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (1, 1.0), (40, 0.9), (1, 0.5), (3, 0.9999999), (500, 0.95)])
def test_top_k_and_its_nucleus_are_the_plain_references_bit_for_bit(top_k, top_p):
    """Top-k alone keeps every token not below the k-th logit (equal ones included); top-k then
    top-p keeps the nucleus of what top-k kept — for rows of every kind, equal logits at the k-th
    and at the nucleus's bound included."""
    from tierspec.sampling import sampling_logits

    for rows in _nucleus_rows(seed=top_k):
        if rows.shape[-1] <= top_k:
            continue
        got = sampling_logits(rows, SamplingConfig(1.0, top_k=top_k, top_p=top_p))
        assert torch.equal(got, _top_k_reference(rows, top_k, top_p))


@pytest.mark.parametrize("config", [SamplingConfig(1.0, top_k=40), SamplingConfig(0.7, top_k=1), SamplingConfig(1.0, top_p=0.95),
                                    SamplingConfig(1.3, top_p=0.5), SamplingConfig(0.7, top_k=40, top_p=0.9),
                                    SamplingConfig(1.0, top_k=3, top_p=0.9999999)])
def test_a_draw_among_the_allowed_tokens_is_the_filtered_rows_draw(config):
    """The keyed draw from the allowed tokens' noise alone is, bit for bit, the keyed draw of the
    whole filtered row (``sampling_logits``: −inf outside top-k and top-p), rows picked or not; a
    NaN row is refused as the whole row's draw refuses it."""
    from tierspec.sampling import NoiseError, keyed_allowed_tokens, keyed_tokens, sampling_logits

    noise = Noise(7, 49152)
    for rows in _nucleus_rows(seed=3)[-6:] + [torch.randn(5, 49152, generator=torch.Generator().manual_seed(4)) * 2]:
        if rows.shape[-1] != 49152:
            continue
        keys = [noise.key(position) for position in range(len(rows))]
        expected = keyed_tokens(sampling_logits(rows, config), keys)
        assert keyed_allowed_tokens(rows, config, keys) == expected
        which = list(range(len(rows)))[::-1]
        assert keyed_allowed_tokens(rows, config, keys[::-1], which) == keyed_tokens(sampling_logits(rows, config),
                                                                                   keys[::-1], rows=which)
    poisoned = torch.randn(1, 49152)
    poisoned[0, 5] = float("nan")
    with pytest.raises(NoiseError, match="NaN"):
        keyed_allowed_tokens(poisoned, config, [noise.key(0)])


def _mass_before_reference(row: torch.Tensor, token: int, config: SamplingConfig) -> float:
    """The mass before ``token`` in float64, plainly: at the temperature, the tokens of a larger logit or an
    equal one and a smaller id, in the softmax of the row or, with top-k, of the tokens not below the k-th
    largest logit; NaN where top-k drops the token, its logit is −inf, or another lies 87 above it (the
    kernel's terms would overflow: such a token, e^-87 of the likeliest's probability, is in no nucleus)."""
    scaled = row / config.temperature
    values = scaled.double()
    own = values[token]
    if own == float("-inf") or float(scaled.max() - scaled[token]) > 87:
        return float("nan")
    before = (values > own) | ((values == own) & (torch.arange(len(row)) < token))
    kept = torch.ones_like(before)
    if config.top_k and config.top_k < len(row):
        if int((values > own).sum()) >= config.top_k:
            return float("nan")
        kept = values >= torch.topk(values, config.top_k).values[-1]
    weights = torch.exp(values - values.max()) * kept
    return float((weights * before).sum() / weights.sum())


@pytest.mark.parametrize("config", [SamplingConfig(1.0, top_p=0.95), SamplingConfig(0.7, top_p=0.5),
                                    SamplingConfig(1.0, top_k=40), SamplingConfig(0.7, top_k=40, top_p=0.9),
                                    SamplingConfig(1.3, top_k=3, top_p=0.6)])
def test_a_token_is_surely_allowed_only_where_the_filters_keep_it(config):
    """``surely_allowed`` against the plain rule: every token it keeps is among ``allowed_tokens`` (ties
    at the token's logit, −inf and flat rows included); it keeps every token whose mass before lies the
    margin below top_p inside top-k (it is no check that never says yes); the kernel's masses, by its
    plain loop and by its vector loop, are the float64 reference's within 1e-6."""
    from tierspec import _keyed_noise
    from tierspec.sampling import allowed_tokens, sure_margin, surely_allowed

    generator = torch.Generator().manual_seed(config.top_k + int(config.top_p * 100))
    said_yes = 0
    for rows in _nucleus_rows(seed=5):
        rows = rows.contiguous()
        vocab = rows.shape[-1]
        if config.top_k >= vocab:
            continue
        for tokens in ([int(torch.randint(vocab, ()).item()) for _ in rows], rows.argmax(-1).tolist(),
                       torch.multinomial((rows / config.temperature).softmax(-1).nan_to_num(1.0), 1, generator=generator)[:, 0].tolist()):
            sure = surely_allowed(rows, config, list(range(len(rows))), tokens)
            for row, token, yes in zip(rows, tokens, sure):
                allowed = set(allowed_tokens(row[None], config)[0].tolist())
                expected = _mass_before_reference(row, token, config)
                assert not yes or token in allowed
                bound = config.top_p - sure_margin(vocab) if config.top_p < 1 else 1.0
                assert yes == (expected < bound) or abs(expected - bound) < 1e-6
                said_yes += yes
            for loop in range(_keyed_noise.best_loop() + 1):
                masses = _keyed_noise.mass_before(rows.data_ptr(), len(rows), vocab, vocab, list(range(len(rows))), tokens,
                                                  config.temperature, config.top_k if config.top_k < vocab else 0,
                                                  config.top_p < 1.0, loop)
                for row, token, mass in zip(rows, tokens, masses):
                    expected = _mass_before_reference(row, token, config)
                    assert (mass != mass and expected != expected) or abs(mass - expected) < 1e-6 \
                        if config.top_p < 1.0 else (mass != mass) == (expected != expected)
    assert said_yes > 10


def test_the_mass_before_a_token_orders_equal_logits_by_id_and_refuses_what_it_cannot_sum():
    """Equal logits lie in id order: of two equal likeliest tokens the first has nothing before it, the
    second the first's mass (just below or above top_p: kept or not). A NaN or +inf row, a token at −inf
    or outside the vocabulary are never sure; a mass within the margin of top_p is left to the nucleus."""
    from tierspec.sampling import keyed_allowed_tokens, keyed_tokens, sampling_logits, sure_margin, surely_allowed

    row = torch.full((1, 300), -30.0)
    row[0, [40, 200]] = 0.0  # two equal likeliest tokens, half the mass each (less e^-30's)
    half = SamplingConfig(1.0, top_p=0.5)
    assert surely_allowed(row, half, [0, 0], [40, 200]) == [True, False]
    margin = sure_margin(300)
    assert surely_allowed(row, SamplingConfig(1.0, top_p=0.5 + 2 * margin), [0], [200]) == [True]
    assert surely_allowed(row, SamplingConfig(1.0, top_p=0.5 + margin / 2), [0], [200]) == [False]  # within the margin
    assert surely_allowed(row, SamplingConfig(1.0, top_k=1), [0, 0], [40, 200]) == [True, True]  # equal to the 1st largest
    cut = row.clone()
    cut[0, 7] = float("-inf")
    poisoned, infinite = row.clone(), row.clone()
    poisoned[0, 3], infinite[0, 3] = float("nan"), float("inf")
    config = SamplingConfig(1.0, top_p=0.9)
    assert surely_allowed(cut, config, [0, 0, 0, 0], [7, -1, -2, 300]) == [False] * 4
    assert surely_allowed(poisoned, config, [0], [40]) == [False]
    assert surely_allowed(infinite, config, [0], [40]) == [False]
    # keyed draws with candidates: right ones, wrong ones, none — always the filtered row's own draw
    noise = Noise(3, 300)
    keys = [noise.key(position) for position in range(6)]
    rows = (torch.randn(6, 300, generator=torch.Generator().manual_seed(2)) * 4).contiguous()
    for config in (SamplingConfig(0.7, top_k=5, top_p=0.8), SamplingConfig(1.0, top_p=0.3)):
        expected = keyed_tokens(sampling_logits(rows, config), keys)
        unfiltered = keyed_tokens(rows / config.temperature, keys)
        assert keyed_allowed_tokens(rows, config, keys, candidates=unfiltered) == expected
        assert keyed_allowed_tokens(rows, config, keys, candidates=[int(r.argmin()) for r in rows]) == expected
        assert keyed_allowed_tokens(rows, config, keys, candidates=[-2] * 6) == expected


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


def test_token_keys_are_the_hash_of_seed_position_and_purpose_in_any_order_of_asking():
    """``Noise.token_keys`` (made ahead in runs, kept while the positions stay in the run): the
    keys ``blake2b("seed/position/token")`` spells out, however the positions are asked — forward,
    back, in runs longer than a run made ahead, after ``forget_before`` — and a block's keys its
    positions' (``BlockNoise.keys``)."""
    import hashlib
    import random

    from tierspec.sampling import TOKEN_KEYS_AHEAD

    def spelled(seed, position):
        return int.from_bytes(hashlib.blake2b(f"{seed}/{position}/token".encode(), digest_size=8).digest(), "little")

    noise, rng = Noise(11, 50), random.Random(0)
    asks = [(0, 1), (3, 2), (15, 1), (15, 2), (16, 40), (2, 1), (100, 3), (99, 1), (101, 2 * TOKEN_KEYS_AHEAD + 3)]
    asks += [(rng.randrange(0, 300), rng.randrange(1, 40)) for _ in range(200)]
    for position, count in asks:
        assert noise.token_keys(position, count) == [spelled(11, p) for p in range(position, position + count)]
        assert noise.key(position) == spelled(11, position)
        noise.forget_before(position)
    assert noise.block(40).keys(5, first=2) == [spelled(11, p) for p in range(42, 47)]
    with pytest.raises(ValueError, match="count"):
        noise.token_keys(5, -1)
    assert noise.token_keys(5, 0) == []
    assert noise.key(7, RESIDUAL) == int.from_bytes(hashlib.blake2b(b"11/7/residual", digest_size=8).digest(), "little")


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


# ---- the keyed noise kernels (csrc/noise/keyed_noise.c) ---------------------------------------------------


def _every_loop(monkeypatch, function):
    """``function()`` on the plain loop and on every vectorised loop this CPU runs (AVX2, AVX-512)."""
    from tierspec import _keyed_noise, sampling

    results = []
    for loop in range(_keyed_noise.best_loop() + 1):
        monkeypatch.setattr(sampling, "_NOISE_LOOP", loop)
        results.append(function())
    return results


def test_a_loop_the_cpu_cannot_run_is_refused():
    from tierspec import _keyed_noise

    table = torch.zeros(1, 8)
    for loop in (-1, 3, _keyed_noise.best_loop() + 1):
        with pytest.raises(ValueError, match="loop"):
            _keyed_noise.argmax_rows(table.data_ptr(), 1, 8, 8, None, [1], loop)


def test_the_noise_loop_follows_the_engines_cap(monkeypatch):
    from tierspec import _keyed_noise, sampling

    for cap, most in (("portable", 0), ("avx2", 1), ("avx512", 2), ("amx", 2), ("", 2)):
        monkeypatch.setenv("TIERSPEC_ENGINE_ISA", cap)
        assert sampling._noise_loop() == min(most, _keyed_noise.best_loop())


def test_the_vectorised_loops_give_the_plain_loops_bits(monkeypatch):
    from tierspec.sampling import gumbel_rows

    keys = [0, 1, 2**64 - 1, 0x9E3779B97F4A7C15, 123456789]
    for vocab in (1, 7, 8, 9, 49152 + 3):  # the AVX2 loop's tails of every length
        runs = _every_loop(monkeypatch, lambda: gumbel_rows(keys, vocab))
        assert all(torch.equal(run.view(torch.int32), runs[0].view(torch.int32)) for run in runs)


def test_the_noise_at_chosen_tokens_is_the_whole_vectors_there(monkeypatch):
    """``gumbel_values``: the whole vector's values at the ids asked, bit for bit, on every loop — ids
    unsorted and repeated, the vocabulary's first and last, tails of every length after the groups of
    eight; ``Noise.gumbel_at`` reads a kept vector where there is one; an id outside the vocabulary
    is refused."""
    from tierspec.sampling import NoiseError, gumbel_rows, gumbel_values

    vocab = 49152
    generator = torch.Generator().manual_seed(4)
    for key in (0, 2**64 - 1, 987654321):
        whole = gumbel_rows([key], vocab)[0]
        for count in (0, 1, 7, 8, 9, 16, 17, 8192):
            ids = torch.randint(0, vocab, (count,), generator=generator)
            if count >= 2:
                ids[0], ids[-1] = 0, vocab - 1
            if count >= 4:
                ids[2] = ids[1]  # a repeat
            for got in _every_loop(monkeypatch, lambda: gumbel_values(key, ids, vocab)):
                assert torch.equal(got.view(torch.int32), whole[ids].view(torch.int32))
    noise = Noise(7, vocab)
    ids = torch.tensor([5, 49151, 3])
    assert torch.equal(noise.gumbel_at(10, ids), noise.gumbel(10)[ids])  # not kept, then kept
    assert torch.equal(noise.block(9).gumbel_at(1, ids), noise.gumbel(10)[ids])
    for bad in ([-1], [3, vocab]):
        with pytest.raises(NoiseError, match=f"token id {bad[-1]} at {len(bad) - 1} is not among the vocabulary's 49152"):
            gumbel_values(1, torch.tensor(bad), vocab)


def test_noise_values_are_the_formula_written_out():
    """g = −ln(−ln u), u = ((mix64(key + (i + 1)·γ) >> 12) + ½)·2⁻⁵², to float32 precision: the
    kernel's own logarithms against numpy's (float64) on the same uniforms."""
    import numpy as np

    from tierspec import _keyed_noise
    from tierspec.sampling import gumbel_rows

    key, vocab = 987654321, 20000
    uniforms = np.array([((_keyed_noise.mix64((key + (i + 1) * 0x9E3779B97F4A7C15) % 2**64) >> 12) + 0.5) * 2.0**-52
                         for i in range(vocab)])
    expected = -np.log(-np.log(uniforms))
    got = gumbel_rows([key], vocab)[0].double().numpy()
    # float32 rounds 36.7 to 4e-6; the kernel's series add at most a few float32 steps more
    assert np.abs(got - expected).max() < 2e-6 * np.maximum(1.0, np.abs(expected)).max()
    assert uniforms.min() >= 2.0**-53 and uniforms.max() <= 1 - 2.0**-53


def _full_argmax(scores: torch.Tensor, keys: list[int]) -> list[int]:
    """The definition: argmax over the whole noise vector, the first of equal maxima."""
    from tierspec.sampling import gumbel_rows

    return (scores + gumbel_rows(keys, scores.shape[1])).argmax(-1).tolist()


def _planted_rows(vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(vocab, generator=generator) * 3  # a language model's spread
    flat = torch.randn(vocab, generator=generator) * 0.01  # near-uniform: many tokens can win
    peaked = torch.full((vocab,), -30.0)
    peaked[[3, vocab // 2, vocab - 1]] = 0.0  # three tied tops: the noise decides
    masked = torch.randn(vocab, generator=generator)
    masked[torch.rand(vocab, generator=generator) < 0.95] = float("-inf")  # top-k / top-p
    masked[vocab // 3] = 1.0  # (one token at least is left)
    equal = torch.zeros(vocab)  # every token tied
    one = torch.full((vocab,), float("-inf"))
    one[vocab - 2] = 5.0  # a single token left
    rows = torch.stack([wide, flat, peaked, masked, equal, one])
    return rows - rows.logsumexp(-1, keepdim=True)


def test_every_loop_draws_rows_of_any_scale_and_length_as_the_whole_noise_vector(monkeypatch):
    """The AVX-512 scan's bound is in float32 and its first step skips the top's index: rows whose top
    lies beyond its reach (|x_top| > 960: the AVX2 scan), near it, tied tops at the ends of the row,
    tails of every length after its groups of 8 and 16, and near-ties by a float32 step give the
    definition's token on every loop."""
    from tierspec.sampling import keyed_argmax

    generator = torch.Generator().manual_seed(3)
    for vocab in (1, 7, 8, 15, 16, 17, 23, 33, 1001):
        base = torch.randn(vocab, generator=generator) * 4
        top = base.max()
        rows = [base, base - top + 959.0, base - top - 959.0, base - top + 961.0, base - 1e6, base * 1e-6]
        tied = torch.full((vocab,), -50.0)
        tied[[0, vocab - 1]] = 2.0  # the top at the first and the last index
        rows.append(tied)
        step = base.clone()
        step[vocab // 2] = base.max() + 4.0
        step[vocab - 1] = torch.nextafter(step[vocab // 2], torch.tensor(float("inf")))  # one float32 step apart
        rows.append(step)
        table = torch.stack(rows)
        for seed in range(12):
            keys = [Noise(seed, vocab).key(t) for t in range(len(table))]
            expected = _full_argmax(table, keys)
            for got in _every_loop(monkeypatch, lambda: keyed_argmax(table, keys)):
                assert got.tolist() == expected


@pytest.mark.parametrize("vocab", [5, 4099, 49152])
def test_the_keyed_argmax_is_the_argmax_over_the_whole_noise_vector(monkeypatch, vocab):
    from tierspec.sampling import keyed_argmax

    rows = _planted_rows(vocab)
    for seed in range(40):
        keys = [Noise(seed, vocab).key(t) for t in range(len(rows))]
        expected = _full_argmax(rows, keys)
        for got in _every_loop(monkeypatch, lambda: keyed_argmax(rows, keys)):
            assert got.tolist() == expected
        strided = torch.cat([rows, torch.zeros(len(rows), 3)], dim=1)[:, :vocab]  # rows of a wider buffer
        assert keyed_argmax(strided, keys).tolist() == expected


def test_rows_shared_among_threads_give_each_rows_own_token_and_errors():
    """From ``PARALLEL_ROWS`` rows on, the rows are claimed one at a time by the caller and the
    workers (``share_rows_among``): every token is the one-thread token, rows of a strided buffer
    too; a NaN row is still named; fewer rows stay on the caller; the count is restored."""
    from tierspec import sampling
    from tierspec.sampling import PARALLEL_ROWS, NoiseError, keyed_argmax, share_rows_among

    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(3 * PARALLEL_ROWS + 1, 4099, generator=generator) * 4
    keys = [Noise(9, 4099).key(t) for t in range(len(rows))]
    alone = keyed_argmax(rows, keys)
    before = share_rows_among(3)
    try:
        assert keyed_argmax(rows, keys).tolist() == alone.tolist()
        wide = torch.cat([rows, torch.zeros(len(rows), 5)], dim=1)[:, :4099]
        assert keyed_argmax(wide, keys).tolist() == alone.tolist()
        calls = []
        original = sampling._rows_shared
        sampling._rows_shared = lambda *args: calls.append(args) or original(*args)
        try:
            keyed_argmax(rows[: PARALLEL_ROWS - 1], keys[: PARALLEL_ROWS - 1])
            assert not calls  # too few rows to hand any to a worker
            keyed_argmax(rows, keys)
            assert [helpers for *_, helpers in calls] == [2]
        finally:
            sampling._rows_shared = original
        rows[PARALLEL_ROWS + 2, 17] = float("nan")
        with pytest.raises(NoiseError, match=f"row {PARALLEL_ROWS + 2} of the scores"):
            keyed_argmax(rows, keys)
    finally:
        assert share_rows_among(before) == 3



def test_chosen_rows_are_drawn_where_they_lie_each_with_its_own_key():
    """``rows``: only those rows, in that order (repeats allowed), each token the one the whole
    table's call gives that row under that key; shared among threads from ``PARALLEL_ROWS`` rows;
    a row outside the table refused, a NaN row named by its index in the table."""
    from tierspec.sampling import PARALLEL_ROWS, NoiseError, keyed_argmax, share_rows_among

    generator = torch.Generator().manual_seed(12)
    table = torch.randn(2 * PARALLEL_ROWS + 3, 4099, generator=generator) * 4
    wide = torch.cat([table, torch.zeros(len(table), 7)], dim=1)[:, :4099]  # rows of a wider buffer
    keys = [Noise(5, 4099).key(t) for t in range(len(table))]
    every = keyed_argmax(table, keys).tolist()
    chosen = [5, 0, 5, 2 * PARALLEL_ROWS + 2] + list(range(6, 6 + PARALLEL_ROWS))
    before = share_rows_among(2)
    try:
        for scores in (table, wide):
            got = keyed_argmax(scores, [keys[r] for r in chosen], rows=chosen).tolist()
            assert got == [every[r] for r in chosen]
            assert keyed_argmax(scores, [keys[3]], rows=[3]).tolist() == [every[3]]
    finally:
        share_rows_among(before)
    with pytest.raises(NoiseError, match=f"not all among the scores' {len(table)}"):
        keyed_argmax(table, [1], rows=[len(table)])
    with pytest.raises(NoiseError, match="2 rows of scores need 2 keys, got 1"):
        keyed_argmax(table, [1], rows=[0, 1])
    table[4, 100] = float("nan")
    with pytest.raises(NoiseError, match="row 4 of the scores"):
        keyed_argmax(table, [keys[1], keys[4]], rows=[1, 4])
    assert keyed_argmax(table, [keys[1]], rows=[1]).tolist() == [every[1]]  # the NaN row is not read


def test_the_keyed_argmax_is_an_exact_draw():
    """Over many keys the token's frequencies are π's (a chi-square test at p > 1e-4)."""
    from scipy.stats import chisquare

    from tierspec.sampling import keyed_argmax

    pi = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    draws = 20000
    noise = Noise(3, len(pi))
    tokens = keyed_argmax(pi.log()[None].expand(draws, -1), [noise.key(t) for t in range(draws)])
    counts = torch.bincount(torch.from_numpy(tokens), minlength=len(pi))
    assert counts[-1] == 0  # probability 0: never
    assert chisquare(counts[:-1].numpy(), (pi[:-1] * draws).numpy()).pvalue > 1e-4


def test_a_nan_is_refused_and_rows_of_equal_scores_take_their_first_token(monkeypatch):
    from tierspec.sampling import NoiseError, keyed_argmax

    with pytest.raises(NoiseError, match="row 1 of the scores to sample from holds a NaN"):
        keyed_argmax(torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0]]), [1, 2])
    with pytest.raises(NoiseError, match="2 rows of scores need 2 keys, got 1"):
        keyed_argmax(torch.zeros(2, 3), [1])
    # every token excluded (a grammar's dead end past a rejection) or +inf: what argmax over the whole
    # vector gives (the first of equal scores), never a refusal
    inf = float("inf")
    rows = torch.tensor([[-inf] * 11, [0.0, inf, 1.0, inf] + [0.0] * 7])
    for got in _every_loop(monkeypatch, lambda: keyed_argmax(rows, [5, 6])):
        assert got.tolist() == _full_argmax(rows, [5, 6]) == [0, 1]


@pytest.mark.parametrize("vocab", [5, 61, 4099, 49152])
def test_first_maxima_are_torchs_argmax_of_the_chosen_rows(monkeypatch, vocab):
    """``first_maxima``: every row's first maximum as ``torch.argmax`` gives it (ties, rows that
    exclude every token, +inf), of chosen rows in their order (repeats allowed) and of rows of a
    wider buffer, on every loop; a NaN row gives −1 (refused by its reader), a
    row outside the table is refused."""
    from tierspec.sampling import SamplingError, first_maxima

    rows = _planted_rows(vocab)
    inf_row = torch.zeros(vocab)
    inf_row[vocab // 2:] = float("inf")
    rows = torch.cat([rows, inf_row[None]])
    expected = rows.argmax(-1).tolist()
    wide = torch.cat([rows, torch.zeros(len(rows), 3)], dim=1)[:, :vocab]
    chosen = [3, 0, 3, len(rows) - 1]
    for table in (rows, wide):
        for got in _every_loop(monkeypatch, lambda: first_maxima(table)):
            assert got == expected
        for got in _every_loop(monkeypatch, lambda: first_maxima(table, chosen)):
            assert got == [expected[r] for r in chosen]
    poisoned = rows.clone()
    poisoned[2, vocab - 1] = float("nan")
    for got in _every_loop(monkeypatch, lambda: first_maxima(poisoned)):
        assert got[2] == -1 and got[:2] + got[3:] == expected[:2] + expected[3:]
    with pytest.raises(SamplingError, match=f"not all among the scores' {len(rows)}"):
        first_maxima(rows, [0, len(rows)])
    assert first_maxima(rows.double(), [1]) == [expected[1]]
    near_tie = torch.tensor([[1.0, 1.0 + 1e-12, 0.5]], dtype=torch.float64)  # equal once rounded to float32
    assert first_maxima(near_tie) == [1]  # other dtypes are reduced in their own precision
    assert first_maxima(torch.empty(0, vocab)) == [] and first_maxima(rows, []) == []
    # rows on an accelerator are reduced by torch there: the same tokens, −1 for a NaN row
    from tierspec.sampling import _first_maxima_by_torch

    assert _first_maxima_by_torch(poisoned) == first_maxima(poisoned)
    assert _first_maxima_by_torch(poisoned, chosen) == first_maxima(poisoned, chosen)
    with pytest.raises(SamplingError, match=f"not all among the scores' {len(rows)}"):
        _first_maxima_by_torch(rows, [len(rows)])


def test_rows_and_keys_may_be_numpy_integers_and_nothing_else():
    """The kernel's entry reads rows and keys through ``__index__``: numpy's integers give the
    tokens Python's do; a float is refused."""
    import numpy as np

    from tierspec.sampling import first_maxima, keyed_tokens

    table = torch.randn(6, 257, generator=torch.Generator().manual_seed(3)) * 3
    keys = [Noise(2, 257).key(t) for t in range(6)]
    rows = [4, 1, 4]
    expected = keyed_tokens(table, [keys[r] for r in rows], rows=rows)
    assert keyed_tokens(table, list(np.asarray([keys[r] for r in rows], dtype=np.uint64)),
                        rows=list(np.asarray(rows))) == expected
    assert first_maxima(table, list(np.asarray(rows))) == table.argmax(-1)[rows].tolist()
    with pytest.raises(TypeError):
        keyed_tokens(table, [1.5], rows=[0])


def test_top_probability_is_the_largest_softmax_probability():
    """A drafter's confidence (the noise extension's, or numpy's) is the largest softmax probability at temperature 1
    (float32 and float64 rows, a flat row, one far-ahead logit), as torch's softmax gives it."""
    from tierspec.sampling import top_probability

    rows = [torch.randn(8192, generator=torch.Generator().manual_seed(3)) * 4, torch.zeros(10),
            torch.tensor([0.0, 30.0, -5.0]), torch.tensor([150.0, 200.0, 199.0]),  # exp(200) overflows float32
            torch.randn(50, dtype=torch.float64), torch.tensor([1.0, 2.5, 2.0], dtype=torch.bfloat16)]
    for row in rows:
        expected = float(row.float().softmax(-1).max())
        assert abs(top_probability(row) - expected) <= 1e-6 * expected
    assert abs(top_probability(torch.zeros(10)) - 0.1) < 1e-7


def test_greedy_choice_is_the_argmax_and_its_confidence_or_none():
    """A greedy draft step's one read of its row: the first maximum (torch's argmax) and the largest
    softmax probability (as ``top_probability``, the same float), None for a row with a NaN or an
    infinity anywhere; rows numpy cannot view take torch's path."""
    from tierspec.sampling import greedy_choice, top_probability

    generator = torch.Generator().manual_seed(5)
    rows = [torch.randn(8192, generator=generator) * 4, torch.tensor([1.0, 3.0, 3.0, -2.0]),  # a tie: the first
            torch.tensor([150.0, 200.0, 199.0]), torch.randn(50, dtype=torch.float64),
            torch.tensor([1.0, 2.5, 2.0], dtype=torch.bfloat16)]
    for row in rows:
        assert greedy_choice(row) == (int(row.argmax()), top_probability(row))
    assert greedy_choice(torch.tensor([1.0, 3.0, 3.0]))[0] == 1
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 2):
            row = torch.tensor([0.5, 2.0, 1.0])
            row[at] = bad
            assert greedy_choice(row) is None and greedy_choice(row.to(torch.bfloat16)) is None


def _top_choice_reference(row):
    """``top_choice``'s probability as its plain loop computes it, in numpy: float32 terms (the clamp, t
    rounded to the nearest integer with ties to even, 2^f's series, 2^n by the exponent's bits), each lane
    of index mod 8 summed in float64 in index order, the lanes added in the loop's fixed order."""
    import numpy as np

    with np.errstate(over="ignore"):  # a difference past float32's range is −inf, clamped as the loop clamps it
        y = np.clip(row - row.max(), np.float32(-87.0), np.float32(87.0)).astype(np.float32)
    t = y * np.float32(1.44269504088896341)
    n = np.rint(t)
    f = t - n
    p = np.full_like(f, np.float32(1.525273380405984e-05))
    for term in (1.5403530393381608e-04, 1.3333558146428443e-03, 9.618129107628477e-03, 5.550410866482158e-02,
                 2.402265069591007e-01, 6.931471805599453e-01, 1.0):
        p = p * f + np.float32(term)
    terms = p * ((n.astype(np.int32) + 127) << 23).view(np.float32)
    lanes = [0.0] * 8
    for v, term in enumerate(terms.tolist()):
        lanes[v & 7] += term
    return 1.0 / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])))


def test_the_extensions_top_choice_is_the_first_maximum_and_its_softmax_probability_on_every_loop():
    """``_keyed_noise.top_choice``, the greedy draft step's one read: the first maximum (torch's argmax,
    ties to the lowest id) and 1 / Σ exp(x − max) within a millionth of a float64 reference, the same
    bits on every loop this CPU runs (rows of every length around the vector width, so each loop's
    tail runs); None for a NaN or an infinity anywhere, a row of −inf included; planted distributions
    exact: a flat row of 10 is 0.1, two equal maxima 0.5, a logit 100 ahead 1.0."""
    from tierspec import _keyed_noise

    loops = range(_keyed_noise.best_loop() + 1)
    generator = torch.Generator().manual_seed(11)
    rows = [torch.randn(n, generator=generator) * scale for n in (1, 7, 8, 9, 15, 16, 17, 31, 33, 8192, 49152)
            for scale in (1.0, 6.0)]
    rows += [torch.tensor([1.0, 3.0, 3.0, -2.0]), torch.tensor([0.0, -90.0, -200.0, -1e30] * 5),  # e^ underflows
             torch.tensor([3.0e38, -3.0e38, 1.0]), torch.tensor([-1.0, 2.0] * 12 + [2.0]),  # ties past the first lanes
             # sums whose rounding the lanes' grouping decides: a half swap or a neighbour swap of the lanes changes them
             torch.tensor([0.0, -100.0, -100.0, -100.0, -37.0, -100.0, -100.0, -100.0, -37.0]),
             torch.tensor([0.0, -37.0] + [-100.0] * 6 + [-37.0])]
    for row in rows:
        reference = row.double()
        expected = float(1.0 / torch.exp(reference - reference.max()).sum())
        choices = {loop: _keyed_noise.top_choice(row.data_ptr(), row.shape[0], loop) for loop in loops}
        index, probability = choices[0]
        assert index == int(row.argmax()), row
        assert abs(probability - expected) <= 1e-6 * expected, (probability, expected)
        assert probability == _top_choice_reference(row.numpy()), row  # the plain loop's own bits
        assert len(set(choices.values())) == 1, choices  # the same index and the same bits on every loop
    flat, tied, far = torch.zeros(10), torch.tensor([2.0, 5.0, 5.0]), torch.tensor([0.0, 100.0])  # alive while read
    for loop in loops:
        assert _keyed_noise.top_choice(flat.data_ptr(), 10, loop) == (0, pytest.approx(0.1, rel=1e-7))
        assert _keyed_noise.top_choice(tied.data_ptr(), 3, loop) == (1, pytest.approx(1.0 / (2.0 + math.exp(-3.0)),
                                                                                          rel=1e-7))
        assert _keyed_noise.top_choice(far.data_ptr(), 2, loop) == (1, 1.0)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for length in (3, 20):
            for at in (0, length - 1):
                row = torch.ones(length)
                row[at] = bad
                assert all(_keyed_noise.top_choice(row.data_ptr(), length, loop) is None for loop in loops), (bad, at)
    minus = torch.full((9,), float("-inf"))
    assert all(_keyed_noise.top_choice(minus.data_ptr(), 9, loop) is None for loop in loops)
    with pytest.raises(ValueError, match="vocab 0"):
        _keyed_noise.top_choice(flat.data_ptr(), 0, 0)
    with pytest.raises(ValueError, match="non-null"):
        _keyed_noise.top_choice(0, 4, 0)
    with pytest.raises(ValueError, match="cannot run loop|not one of"):
        _keyed_noise.top_choice(flat.data_ptr(), 4, 3)


def test_greedy_choice_reads_rows_the_extension_cannot_through_numpy_or_torch():
    """A contiguous float32 row goes to the extension (one call, its bits); a strided float32 row and a
    float64 row give what a contiguous float32 copy gives through it (the index exactly, the probability
    within a float's rounding); an empty row is refused with a clear error."""
    from tierspec import sampling
    from tierspec.sampling import SamplingError, greedy_choice

    table = torch.randn(64, 3, generator=torch.Generator().manual_seed(2)) * 3
    strided = table[:, 1]
    assert strided.stride(0) != 1
    calls, top_choice = [], sampling._keyed_noise.top_choice

    def counted(*args):
        calls.append(args)
        return top_choice(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sampling._keyed_noise, "top_choice", counted)
        patch.setattr(sampling, "_NOISE_LOOP", 1 if sampling._keyed_noise.best_loop() else 0)
        index, probability = greedy_choice(strided.contiguous())
        vector = sampling._NOISE_LOOP > 0  # the plain loop (a CPU without AVX2, or TIERSPEC_ENGINE_ISA=portable): numpy's
        assert len(calls) == vector and sampling.top_probability(strided.contiguous()) == probability
        assert len(calls) == 2 * vector
        greedy_choice(strided)
        assert len(calls) == 2 * vector  # a strided row: numpy's path
        patch.setattr(sampling, "_NOISE_LOOP", 0)
        assert greedy_choice(strided.contiguous())[0] == index and len(calls) == 2 * vector
    assert index == int(strided.argmax())
    for row in (strided, strided.double()):
        other_index, other_probability = greedy_choice(row)
        assert other_index == index
        assert abs(other_probability - probability) <= 2e-6 * probability
    with pytest.raises(SamplingError, match="empty row"):
        greedy_choice(torch.zeros(0, dtype=torch.float64))


@pytest.mark.parametrize("config", [SamplingConfig(0.7, top_k=40, top_p=0.9), SamplingConfig(1.0, top_k=40),
                                    SamplingConfig(1.3, top_k=3, top_p=0.6), SamplingConfig(0.5, top_k=200, top_p=0.95),
                                    SamplingConfig(1.0, top_k=1, top_p=0.5)])
def test_the_allowed_tokens_from_the_k_largest_are_the_rows_where_plain_and_refused_at_a_tie_or_the_bound(config):
    """``_plain_top_k_allowed`` (a row whose unfiltered draw the filters drop): where it answers, its ids
    are ``allowed_tokens``' (random rows of several spreads, rows with repeated logits); it answers most
    rows (it is no check that never says yes); it refuses a tie at the k-th largest and a survivor whose
    mass before lies at top_p; and draws through it are the filtered rows' draws, bit for bit."""
    from tierspec.sampling import _plain_top_k_allowed, allowed_tokens, keyed_allowed_tokens, keyed_tokens, sampling_logits

    generator = torch.Generator().manual_seed(config.top_k)
    rows = [torch.randn(49152, generator=generator) * scale for scale in (0.5, 2.0, 4.0, 8.0) for _ in range(6)]
    rows += [torch.randint(-6, 4, (4096,), generator=generator).float() for _ in range(6)]  # a tie at the k-th
    paired = []  # equal logits inside the k largest (in pairs), the (k + 1)-th below them: answered
    for _ in range(6):
        row = torch.randn(49152, generator=generator) * 3
        top = torch.topk(row, config.top_k + 1).indices
        for j in range(1, config.top_k, 2):
            row[top[j]] = row[top[j - 1]]
        paired.append(row)
    answered = 0
    for row in rows + paired:
        ids = _plain_top_k_allowed(row, config)
        if ids is not None:
            answered += 1
            assert ids.tolist() == allowed_tokens(row[None], config)[0].tolist()
    # (under top-p a pair's two masses before may straddle the bound: such a row is refused)
    assert answered >= 20 and sum(_plain_top_k_allowed(row, config) is not None for row in paired) >= 3
    tied = torch.full((300,), -5.0)
    tied[:config.top_k + 1] = 1.0  # k + 1 equal largest: top-k keeps them all
    assert _plain_top_k_allowed(tied, config) is None
    if config.top_p < 1.0 and config.top_k >= 2:
        at_bound = -80.0 - 0.01 * torch.arange(300.0)  # distinct, each e^-80 of the two below
        at_bound[[3, 9]] = 0.0  # two equal survivors, half the mass each: the second's mass before is 1/2
        assert _plain_top_k_allowed(at_bound, SamplingConfig(config.temperature, config.top_k, 0.5)) is None
        assert _plain_top_k_allowed(at_bound, SamplingConfig(config.temperature, config.top_k, 0.51)).tolist() == [3, 9]
        assert _plain_top_k_allowed(at_bound, SamplingConfig(config.temperature, config.top_k, 0.49)).tolist() == [3]
    noise = Noise(11, 49152)
    table = torch.stack(rows[:24]).contiguous()
    keys = [noise.key(position) for position in range(len(table))]
    dropped = [int(r.argmin()) for r in table]  # every row's "unfiltered draw" outside the filters
    expected = keyed_tokens(sampling_logits(table, config), keys)
    assert keyed_allowed_tokens(table, config, keys, candidates=dropped) == expected
