"""A proposal's per-node fields: draft logits given as their steps' rows are the stacked rows when read."""

import torch

from tierspec.proposal import Proposal


def _rows(k: int, width: int = 6) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(k)
    return [torch.randn(width, generator=generator) for _ in range(k)]


def test_logits_given_as_rows_are_their_stack_read_once():
    rows = _rows(3)
    proposal = Proposal.chain([4, 1, 2], logits=rows, confidence=[0.9, 0.5, 0.7])
    logits = proposal.logits
    assert torch.equal(logits, torch.stack(rows))
    assert proposal.logits is logits  # stacked once, then kept
    assert Proposal.chain([4], logits=torch.stack(rows[:1])).logits.shape == (1, 6)
    assert Proposal.chain([4]).logits is None


def test_a_prefix_cuts_rows_not_yet_stacked_and_stacked_ones_alike():
    rows = _rows(4)
    unread = Proposal.chain([4, 1, 2, 3], logits=list(rows), confidence=[0.9, 0.5, 0.7, 0.2])
    cut = unread.prefix(2)
    assert torch.equal(cut.logits, torch.stack(rows[:2])) and cut.confidence == [0.9, 0.5]
    assert isinstance(unread._logits, list)  # the prefix did not stack the whole block
    assert unread.prefix(0).logits.shape == (0, 6)  # as a stacked block's cut to nothing
    assert Proposal.chain([4, 1], confidence=[0.5, 0.4]).prefix(1).logits is None
    read = Proposal.chain([4, 1, 2, 3], logits=list(rows))
    read.logits
    assert torch.equal(read.prefix(3).logits, torch.stack(rows[:3]))


def test_draft_logits_widen_rows_given_as_a_list():
    rows = _rows(2, width=3)
    vocabulary = torch.tensor([5, 0, 2])
    proposal = Proposal.chain([5, 2], logits=rows, vocabulary=vocabulary, vocab_size=7)
    wide = proposal.draft_logits
    assert wide.shape == (2, 7)
    assert torch.equal(wide[:, vocabulary], torch.stack(rows))
    assert torch.isneginf(wide[:, [1, 3, 4, 6]]).all()
