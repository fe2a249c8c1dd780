"""The chains of a whole batch decided in one step (``walks.chain_batch_walks``, flat in the manner
of vLLM v1's rejection sampler) give bitwise the walks each sequence gets alone
(``walks.exact_walk``): planted batches of mixed draft lengths, greedy and sampled sequences,
temperatures, top-k and top-p, drafts that are all right, all wrong or right up to a point."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tierspec.proposal import Proposal
from tierspec.sampling import Noise, SamplingConfig, first_maxima
from tierspec.walks import ChainBatch, chain_batch_walks, exact_walk, perturbed_target_tokens

SAMPLINGS = [SamplingConfig(), SamplingConfig(1.0), SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8),
             SamplingConfig(1.0)]


def own_tokens(logits, sampling, noise) -> torch.Tensor:
    """The target's own token after each row of one sequence's logits [k + 1, V], as ``exact_walk``
    reads them: the argmax, or the perturbed argmax with each row's position noise."""
    if sampling.greedy:
        return logits.argmax(-1)
    return torch.from_numpy(perturbed_target_tokens(logits, sampling, noise.keys(len(logits))))


def planted_batch(vocab: int, drafts_per_sequence: list[int], seed: int):
    """Per sequence: logits [k + 1, V], its sampling, its block noise, and drafts planted to agree
    with the target's own tokens up to a chosen point (all, none, or some)."""
    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for index, k in enumerate(drafts_per_sequence):
        logits = torch.randn(k + 1, vocab, generator=generator) * 3
        sampling = SAMPLINGS[index % len(SAMPLINGS)]
        noise = None if sampling.greedy else Noise(seed * 100 + index, vocab).block(40 + index)
        own = own_tokens(logits, sampling, noise)
        agree = [k, 0, k // 2, 1][index % 4]  # drafts 0 .. agree − 1 are the target's own tokens
        drafts = own[:k].clone()
        drafts[agree:] = (drafts[agree:] + 1) % vocab
        sequences.append((Proposal.chain(drafts), logits, sampling, noise))
    return sequences


@pytest.mark.parametrize("vocab", [64, 61, 49152])  # 61: rows whose length is not a multiple of any vector width
@pytest.mark.parametrize("drafts_per_sequence", [[3], [0, 0, 0], [4, 0, 2, 7, 1], [5, 5, 5, 5, 5, 5, 5, 5]])
def test_a_batch_decided_at_once_is_each_sequence_decided_alone(vocab, drafts_per_sequence):
    sequences = planted_batch(vocab, drafts_per_sequence, seed=len(drafts_per_sequence) + vocab)
    batch = ChainBatch([t for p, _, _, _ in sequences for t in p.token_list], [len(p) for p, _, _, _ in sequences],
                       torch.cat([logits for _, logits, _, _ in sequences]), [s for _, _, s, _ in sequences],
                       [n for _, _, _, n in sequences])
    together = chain_batch_walks(batch)
    alone = [exact_walk(p, logits, sampling, noise) for p, logits, sampling, noise in sequences]
    assert [(w.path, w.next_token) for w in together] == [(w.path, w.next_token) for w in alone]
    # the rows' first maxima as a pass finds them: the greedy sequences read those (and the logits
    # only where some sequence samples)
    with_maxima = dataclasses.replace(batch, row_maxima=first_maxima(batch.target_logits))
    if all(sampling.greedy for sampling in batch.samplings):
        with_maxima = dataclasses.replace(with_maxima, target_logits=None)
    assert [(w.path, w.next_token) for w in chain_batch_walks(with_maxima)] == [(w.path, w.next_token) for w in alone]
    # the planted agreement shows: all kept, none, half, one
    for index, (walk, k) in enumerate(zip(together, drafts_per_sequence)):
        assert walk.accepted == [k, 0, k // 2, 1][index % 4] or k == 0 and walk.accepted == 0


def test_a_sampled_row_is_drawn_only_once_its_walk_reaches_it(monkeypatch):
    """Sampled sequences are walked depth by depth: the perturbed argmax of a row after a rejected
    draft is never drawn (its row may even hold a NaN), and the walks are still each sequence's own."""
    import tierspec.walks as walks

    vocab, generator = 96, torch.Generator().manual_seed(4)
    plans = [(3, 1, SamplingConfig(1.0)), (2, 2, SamplingConfig(1.0)), (0, 0, SamplingConfig(1.0)),
             (2, 0, SamplingConfig(0.7, top_k=9)), (1, 1, SamplingConfig())]  # (drafts, accepted, sampling)
    sequences = []
    for index, (k, agree, sampling) in enumerate(plans):
        logits = torch.randn(k + 1, vocab, generator=generator) * 3
        noise = None if sampling.greedy else Noise(77 + index, vocab).block(30 + index)
        drafts = own_tokens(logits, sampling, noise)[:k].clone()
        drafts[agree:] = (drafts[agree:] + 1) % vocab
        sequences.append((Proposal.chain(drafts), logits, sampling, noise))
    alone = [exact_walk(p, logits, sampling, noise) for p, logits, sampling, noise in sequences]
    poisoned = [logits.clone() for _, logits, _, _ in sequences]
    poisoned[0][2:] = float("nan")  # after sequence 0's rejected second draft
    poisoned[3][1:] = float("nan")  # after sequence 3's rejected first draft
    drawn = []
    real = walks._perturbed_rows
    monkeypatch.setattr(walks, "_perturbed_rows", lambda logits, rows, sampling, keys, candidates=None:
                        drawn.append(list(rows)) or real(logits, rows, sampling, keys, candidates))
    batch = ChainBatch([t for p, _, _, _ in sequences for t in p.token_list], [len(p) for p, _, _, _ in sequences],
                       torch.cat(poisoned), [s for _, _, s, _ in sequences], [n for _, _, _, n in sequences])
    together = chain_batch_walks(batch)
    assert [(w.path, w.next_token) for w in together] == [(w.path, w.next_token) for w in alone]
    assert [w.accepted for w in together] == [1, 2, 0, 0, 1]
    # rows by sequence: 0 → 0..3, 1 → 4..6, 2 → 7, 3 → 8..10, 4 → 11..12 (greedy: all at once, not here)
    assert sorted(row for rows in drawn for row in rows) == [0, 1, 4, 5, 6, 7, 8]
    assert len(drawn) == 4  # depth 0: two settings (temperature 1; 0.7 with top-k), depths 1 and 2: one each


@pytest.mark.parametrize("drafts_per_sequence", [[3, 2], [4, 0, 2, 7, 1], [5, 5, 5, 5, 5, 5, 5, 5]])
def test_the_draws_a_pass_made_decide_the_sampled_walks_and_the_rest_are_drawn_here(monkeypatch, drafts_per_sequence):
    """``ChainBatch.row_draws``: where the pass drew a sampled row (``cached_model.RowDraws``), the walk takes that
    token and draws nothing itself; rows marked ``NOT_DRAWN`` (greedy rows, top-k and top-p rows, a row the
    engine left) are drawn here as before: the walks are each sequence's own. A planted draw shows it is read,
    and a draw of −1 (a NaN row) is refused where the walk reaches it."""
    import tierspec.walks as walks
    from tierspec.sampling import NOT_DRAWN, NoiseError

    sequences = planted_batch(61, drafts_per_sequence, seed=5)
    alone = [exact_walk(p, logits, sampling, noise) for p, logits, sampling, noise in sequences]
    draws, rows = [], 0
    for index, (proposal, logits, sampling, noise) in enumerate(sequences):
        plain = not sampling.greedy and not sampling.top_k and sampling.top_p >= 1.0
        own = own_tokens(logits, sampling, noise).tolist()
        draws += [own[j] if plain and (index + j) % 3 else NOT_DRAWN for j in range(len(own))]  # some rows left
        rows += len(own)
    batch = ChainBatch([t for p, _, _, _ in sequences for t in p.token_list], [len(p) for p, _, _, _ in sequences],
                       torch.cat([logits for _, logits, _, _ in sequences]), [s for _, _, s, _ in sequences],
                       [n for _, _, _, n in sequences], row_draws=draws)
    drawn = []
    real = walks._perturbed_rows
    monkeypatch.setattr(walks, "_perturbed_rows", lambda logits, rows, sampling, keys, candidates=None:
                        drawn.extend(rows) or real(logits, rows, sampling, keys, candidates))
    assert [(w.path, w.next_token) for w in chain_batch_walks(batch)] == [(w.path, w.next_token) for w in alone]
    assert all(draws[row] == NOT_DRAWN for row in drawn)  # only the rows the pass left
    sampled = [i for i, (_, _, s, _) in enumerate(sequences) if not s.greedy and not s.top_k and s.top_p >= 1.0]
    first = sum(len(p) + 1 for p, _, _, _ in sequences[: sampled[0]])
    planted = list(draws)
    taken = {alone[sampled[0]].next_token, *sequences[sampled[0]][0].token_list[:1]}
    planted[first] = min(set(range(61)) - taken)  # the first row's token: neither its draft nor the walk's own
    moved = chain_batch_walks(dataclasses.replace(batch, row_draws=planted))[sampled[0]]
    assert (moved.accepted, moved.next_token) == (0, planted[first])
    planted[first] = -1
    with pytest.raises(NoiseError, match=f"row {first} of the scores to sample from holds a NaN"):
        chain_batch_walks(dataclasses.replace(batch, row_draws=planted))
    with pytest.raises(ValueError, match="rows' draws"):
        chain_batch_walks(dataclasses.replace(batch, row_draws=draws[:-1]))


@pytest.mark.parametrize("vocab", [61, 49152])
def test_a_pass_draw_under_top_k_or_top_p_is_a_candidate_the_filters_decide(monkeypatch, vocab):
    """Under top-k or top-p a pass's draw is the unfiltered row's (``decode._row_draws``): the walk keeps it
    only where the filters surely allow it (``sampling.surely_allowed``), else finds the row's allowed tokens —
    the walks are each sequence's own either way. Most rows are settled by the check (no allowed tokens found);
    a planted draw the filters drop, or one of a row whose mass lies at the bound, is not taken."""
    import tierspec.sampling as sampling_module
    from tierspec.sampling import keyed_tokens

    samplings = [SamplingConfig(0.7, top_k=5), SamplingConfig(1.3, top_p=0.8), SamplingConfig(1.0, top_k=9, top_p=0.9),
                 SamplingConfig(1.0)]
    generator = torch.Generator().manual_seed(vocab)
    sequences, draws = [], []
    for index in range(8):
        k = [3, 0, 5, 2][index % 4]
        logits = torch.randn(k + 1, vocab, generator=generator) * 3
        for row in logits:  # a language model's rows: most of the mass on a few tokens
            row[torch.randint(vocab, (3,), generator=generator)] += 14
        sampling = samplings[index % len(samplings)]
        noise = Noise(500 + index, vocab).block(9 * index)
        own = own_tokens(logits, sampling, noise)
        drafts = own[:k].clone()
        drafts[k // 2 + 1 :] = (drafts[k // 2 + 1 :] + 1) % vocab
        sequences.append((Proposal.chain(drafts), logits, sampling, noise))
        draws += keyed_tokens(logits / sampling.temperature, noise.keys(k + 1))  # what a pass draws: no filter
    alone = [exact_walk(p, logits, sampling, noise) for p, logits, sampling, noise in sequences]
    batch = ChainBatch([t for p, _, _, _ in sequences for t in p.token_list], [len(p) for p, _, _, _ in sequences],
                       torch.cat([logits for _, logits, _, _ in sequences]), [s for _, _, s, _ in sequences],
                       [n for _, _, _, n in sequences], row_draws=draws)
    nuclei, plain = [], []
    real, real_plain = sampling_module.allowed_tokens, sampling_module._plain_top_k_allowed
    monkeypatch.setattr(sampling_module, "allowed_tokens", lambda rows, config: nuclei.append(len(rows)) or real(rows, config))

    def counted_plain(row, config):
        ids = real_plain(row, config)
        plain.append(ids is not None)
        return ids

    monkeypatch.setattr(sampling_module, "_plain_top_k_allowed", counted_plain)
    assert [(w.path, w.next_token) for w in chain_batch_walks(batch)] == [(w.path, w.next_token) for w in alone]
    filtered_rows = sum(min(w.accepted + 1, len(p) + 1) for w, (p, _, s, _) in zip(alone, sequences) if s.top_k or s.top_p < 1)
    if sampling_module.CHECKS_UNFILTERED_DRAWS:  # (without AVX2 every row finds its allowed tokens)
        assert len(nuclei) + sum(plain) < filtered_rows / 2  # most rows settled by their draw
    # A draw the filters drop is never the filtered row's token: planted on every filtered row, the walks hold.
    first, planted = 0, list(draws)
    for proposal, logits, sampling, _ in sequences:
        if sampling.top_k or sampling.top_p < 1:
            for row in range(len(proposal) + 1):
                planted[first + row] = int(logits[row].argmin())  # below top-k and outside any nucleus
        first += len(proposal) + 1
    nuclei.clear()
    plain.clear()
    assert [(w.path, w.next_token) for w in chain_batch_walks(dataclasses.replace(batch, row_draws=planted))] == \
        [(w.path, w.next_token) for w in alone]
    # every filtered row found its allowed tokens: from its k largest logits where plain, else the nucleus's way
    assert len(nuclei) + sum(plain) == filtered_rows and sum(plain) > 0
    with pytest.raises(ValueError, match="checked against their logits"):  # draws of filtered rows and no logits
        chain_batch_walks(dataclasses.replace(batch, target_logits=None))


def test_a_greedy_walk_refuses_a_nan_row_it_reads_and_only_that():
    """Greedy rows are taken all at once (``sampling.first_maxima``); a row holding a NaN is
    refused when the walk reaches it, and never read (nor refused) past a rejected draft."""
    from tierspec.errors import TierspecError

    vocab, generator = 61, torch.Generator().manual_seed(8)
    logits = torch.randn(4, vocab, generator=generator) * 3
    own = logits.argmax(-1)
    drafts = own[:3].clone()
    drafts[1] = (drafts[1] + 1) % vocab  # the second draft rejected: rows 2 and 3 are never read
    poisoned = logits.clone()
    poisoned[2:] = float("nan")
    walk = chain_batch_walks(ChainBatch(drafts.tolist(), [3], poisoned, [SamplingConfig()], [None]))[0]
    assert (walk.accepted, walk.next_token) == (1, int(own[1]))
    poisoned[1, 5] = float("nan")  # the row the walk reads after the first draft
    with pytest.raises(TierspecError, match="row 1 of the target's scores holds a NaN"):
        chain_batch_walks(ChainBatch(drafts.tolist(), [3], poisoned, [SamplingConfig()], [None]))


def test_a_lone_greedy_walk_refuses_a_nan_row_it_reads_as_the_batch_does():
    """``greedy_walk`` and the tree walk read rows one at a time (``sampling.row_argmax``): a NaN
    row they reach is refused, one past the rejection is not read."""
    from tierspec.sampling import SamplingError
    from tierspec.walks import greedy_walk

    vocab, generator = 61, torch.Generator().manual_seed(9)
    logits = torch.randn(4, vocab, generator=generator) * 3
    own = logits.argmax(-1)
    drafts = own[:3].clone()
    drafts[1] = (drafts[1] + 1) % vocab
    poisoned = logits.clone()
    poisoned[2:] = float("nan")
    walk = greedy_walk(drafts, poisoned)
    assert (walk.accepted, walk.next_token) == (1, int(own[1]))
    poisoned[1, 7] = float("nan")
    with pytest.raises(SamplingError, match="row 1 of the target's scores holds a NaN"):
        greedy_walk(drafts, poisoned)
