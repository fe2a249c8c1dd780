"""A drafting model's steps (``drafting_autoregressively``): each draft is fed back through the
drafter's own one-token views, the argmax of its logits row over the drafter's vocabulary."""

import torch

from tierspec.drafters.base import DraftFeeds, drafting_autoregressively
from tierspec.policies import FixedLength
from tierspec.proposal import DraftRequest
from tierspec.sampling import SamplingConfig

GREEDY = SamplingConfig(0.0)


def _block(rows: list[torch.Tensor], budget: int, feeds: DraftFeeds | None, vocabulary=None):
    """Run one block, answering each step with the next row; returns (the views fed, the proposal)."""
    steps = drafting_autoregressively(torch.tensor([3]), DraftRequest(budget, GREEDY, None, FixedLength(budget)),
                                      "head", vocabulary, 0 if vocabulary is None else 50, feeds)
    fed = [next(steps)]
    try:
        for row in rows:
            fed.append(steps.send(row))
    except StopIteration as done:
        return fed, done.value
    raise AssertionError("the block did not end")


def test_drafts_are_fed_back_through_the_drafters_own_views_block_after_block():
    rows = [torch.tensor([0.0, 5.0, 1.0, 2.0]), torch.tensor([4.0, 0.0, 1.0, 2.0]), torch.tensor([0.0, 0.0, 1.0, 9.0])]
    vocabulary = torch.tensor([10, 11, 12, 13])
    feeds = DraftFeeds(3)
    fed, proposal = _block(rows, 3, feeds, vocabulary)
    assert proposal.token_list == [11, 10, 13] and [int(t) for t in fed[1:]] == [11, 10]
    assert fed[1] is feeds.view(0) and fed[2] is feeds.view(1)  # the drafter's views, not new tensors
    again, proposal = _block(rows[::-1], 3, feeds, vocabulary)
    assert proposal.token_list == [13, 10, 11] and again[1] is fed[1] and int(again[1]) == 13
    longer, proposal = _block(rows + rows, 5, feeds, vocabulary)  # more drafts than the buffer holds: a larger one
    assert [int(t) for t in longer[1:]] == [11, 10, 13, 11] and len(proposal) == 5
    assert len(feeds.values) == 5 and longer[1] is feeds.view(0)  # grown in place: the drafter keeps it
    assert [int(t) for t in _block(rows, 3, None)[0][1:]] == [1, 0]  # no feeds given: made for the block
