"""Prompt lookup on planted contexts."""

import numpy as np
import pytest
import torch

from conftest import draft_request

from tierspec.drafters import NgramDrafter
from tierspec.sampling import SamplingConfig


def lookup(context, k, **kwargs):
    return NgramDrafter(**kwargs).lookup(np.array(context), k)[0].tolist()


def test_longest_suffix_match_continues():
    assert lookup([1, 2, 3, 9, 8, 7, 1, 2, 3], 3) == [9, 8, 7]


def test_most_recent_match_wins():
    assert lookup([1, 2, 5, 1, 2, 6, 0, 1, 2], 1, ngram_size=2) == [6]


def test_falls_back_to_shorter_ngrams():
    # [4, 2] never occurred before, [2] did (followed by 7)
    assert lookup([2, 7, 4, 2], 2, ngram_size=2) == [7, 4]


def test_min_ngram_size_blocks_short_matches():
    assert lookup([2, 7, 4, 2], 2, ngram_size=2, min_ngram_size=2) == []


def test_continuation_truncated_at_context_end():
    assert lookup([1, 2, 1, 2], 5, ngram_size=2) == [1, 2]


def test_no_match_gives_empty_proposal():
    proposal = NgramDrafter(3).propose(np.array([1, 2, 3, 4]), draft_request(4))
    assert len(proposal) == 0 and proposal.draft_probs is None


def test_budget_caps_the_block_and_tokens_carry_their_match_size():
    proposal = NgramDrafter(2).propose(np.array([1, 2, 3, 4, 5, 1, 2]), draft_request(2))
    assert proposal.tokens.tolist() == [3, 4]
    assert proposal.match_sizes == [2, 2] and proposal.source == "ngram"
    assert NgramDrafter(3).lookup(np.array([2, 7, 4, 2]), 2)[1] == 1  # fell back to a 1-gram match


def brute_force_lookup(text: list[int], num_tokens: int, ngram_size: int, min_ngram_size: int):
    """Prompt lookup written out: for n from the longest, the latest earlier window equal to the
    last n tokens, and what followed it."""
    for n in range(min(ngram_size, len(text) - 1), min_ngram_size - 1, -1):
        for start in range(len(text) - 1 - n, -1, -1):
            if text[start : start + n] == text[len(text) - n :]:
                return text[start + n : start + n + num_tokens], n
    return [], 0


def test_the_indexed_lookup_equals_the_written_out_one_as_the_text_grows():
    """The drafter indexes the committed text as it grows (and the source, and a context that does
    not extend the last one: a new generation): every proposal equals a search of the whole text."""
    from tierspec.drafters.ngram import suffix_matches

    rng = np.random.default_rng(1)
    for trial in range(300):
        drafter = NgramDrafter(int(rng.integers(1, 5)))
        drafter.min_ngram_size = int(rng.integers(1, drafter.ngram_size + 1))
        source = None
        if trial % 3 == 0:
            source = torch.tensor(rng.integers(0, 4, int(rng.integers(1, 10))))
            drafter.set_source(source)
        sequence = rng.integers(0, int(rng.integers(1, 5)), 50).tolist()
        if trial % 4 == 1:  # ids at the top of the packed range and past it (the index's keys tuples then)
            alphabet = [0, (1 << 21) - 1, 1 << 21, 1 << 40] if trial % 8 == 1 else [2, (1 << 21) - 2, (1 << 21) - 1, 7]
            sequence = [alphabet[token % len(alphabet)] for token in sequence]
        for length in list(range(int(rng.integers(1, 6)), 50, int(rng.integers(1, 4)))) + [7]:  # 7: starts over
            budget = int(rng.integers(0, 6))
            proposal = drafter.propose(np.array(sequence[:length]), draft_request(budget))
            text = ([] if source is None else source.tolist()) + sequence[:length]
            found, size = brute_force_lookup(text, budget, drafter.ngram_size, drafter.min_ngram_size) if budget else ([], 0)
            assert proposal.tokens.tolist() == found and (not found or proposal.match_sizes == [size] * len(found))
            for n in range(1, 5):  # the array search the trie and CS Drafting use agrees too
                expected = [s for s in range(len(text) - n) if text[s : s + n] == text[len(text) - n :]]
                assert suffix_matches(np.array(text), n).tolist() == expected


@pytest.mark.parametrize("bulk", [0, 8, 10**9])
def test_the_index_holds_each_ngrams_latest_end_however_the_text_grew(monkeypatch, bulk):
    """``NgramDrafter._indexed``: after each growth of the text (by nothing, one token or many, from
    empty or a prompt, after a source, and after a shorter context: a new generation begun without
    ``start``), for every size n the index maps each n-gram ending before the searched text's
    last token to its latest end — what a loop over every position and size, written out, makes —
    whether the growth goes through the loop or the array operations (``BULK_INDEX``: both ways
    forced, and the default), with the keys packed (every id below 2**KEY_BITS; sizes past an
    int64's three packed in Python) or, once an id does not pack, tuples."""
    import random

    from tierspec.drafters import ngram
    from tierspec.drafters.ngram import KEY_BITS, ngram_key

    monkeypatch.setattr(ngram, "BULK_INDEX", bulk)

    def written_out(text, sizes):
        packed = all(0 <= token < 1 << KEY_BITS for token in text)
        index = [{} for _ in range(sizes)]
        for end in range(len(text) - 1):
            for n in range(1, min(sizes, end + 1) + 1):
                index[n - 1][ngram_key(text[end - n + 1 : end + 1], packed)] = end
        return index

    rng, checks, unpacked = random.Random(bulk % 7), 0, 0
    for trial in range(200):
        sizes = rng.randint(1, 6)
        drafter, vocab = NgramDrafter(sizes), rng.choice([2, 3, 5, 50, 1 << KEY_BITS])
        # ids at the top of the packed range, and (a few generations) one past it or far past it
        top = [(1 << KEY_BITS) - 1 - i for i in range(3)] + ([1 << KEY_BITS, 1 << 40] if trial % 5 == 1 else [])

        def token():
            return rng.choice(top) if rng.random() < 0.1 else rng.randrange(vocab)

        source = [token() for _ in range(rng.randint(1, 8))] if trial % 3 == 0 else []
        if source:
            drafter.set_source(torch.tensor(source))
        text = [token() for _ in range(rng.randint(0, 60))]
        unpacked += not drafter._packable(source + text)
        at = rng.randint(0, len(text))
        while True:
            drafter._indexed(np.array(text[:at], dtype=np.int64))
            assert drafter._last_end == written_out(source + text[:at], sizes)
            checks += 1
            if at >= len(text):
                break
            at = min(len(text), at + rng.randint(0, 20))
        if len(text) > 1 and trial % 4 == 2:  # earlier tokens changed, the last indexed kept: taken as an extension
            known = len(source) + len(text)  # the drafter keeps its text and indexes the new tokens only
            changed = [token() for _ in range(len(text) - 1)] + text[-1:] + [token() for _ in range(rng.randint(1, 30))]
            drafter._indexed(np.array(changed, dtype=np.int64))
            kept = source + text + changed[len(text):]
            assert drafter._last_end == written_out(kept, sizes) and drafter._text == kept and known < len(kept)
            text = changed  # (the shorter context below: a new generation's, indexed afresh)
        if len(text) > 1:  # a shorter context, so not an extension (a new generation): indexed afresh
            other = [token() for _ in range(rng.randint(1, len(text) - 1))]
            drafter._indexed(np.array(other, dtype=np.int64))
            assert drafter._last_end == written_out(source + other, sizes)
            assert drafter._packed == drafter._packable(source + other)
    assert checks > 500 and 10 < unpacked < 100
