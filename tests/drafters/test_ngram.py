"""Prompt lookup on planted contexts."""

import numpy as np
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
    proposal = NgramDrafter(3).propose(torch.tensor([1, 2, 3, 4]), draft_request(4))
    assert len(proposal) == 0 and proposal.draft_probs is None


def test_budget_caps_the_block_and_tokens_carry_their_match_size():
    proposal = NgramDrafter(2).propose(torch.tensor([1, 2, 3, 4, 5, 1, 2]), draft_request(2))
    assert proposal.tokens.tolist() == [3, 4]
    assert proposal.match_sizes == [2, 2] and proposal.source == "ngram"
    assert NgramDrafter(3).lookup(np.array([2, 7, 4, 2]), 2)[1] == 1  # fell back to a 1-gram match
