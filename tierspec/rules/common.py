"""The one acceptance walk every verification rule uses, and the draft rows it reads.

A rule supplies, per drafted position i, the probability of keeping x_i (for the mixture rules
min(1, π_i(x_i)/p_i(x_i))), the distribution to draw from when x_i is not kept (its residual
norm(max(0, π_i − p_i))), and the bonus distribution after a fully kept block. The walk keeps x_1,
x_2, … in order and ends the block at the first token not kept (docs/algorithms.md §Verification
rules). Greedy mode is the same walk over one-hot distributions; a deterministic replacement may be
given as a token id.

Randomness comes from the block's keyed noise (``sampling.BlockNoise``): the coin of position i
and the replacement drawn there are keyed by i's absolute position, independent of each other and
of the drafts (which use the token noise); the bonus token is drawn with the token noise, like
plain decoding's. So a rule's outcome depends only on the seed and the positions, not on how
many draws earlier blocks made.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..drafters.base import Proposal
from ..errors import TierspecError
from ..sampling import BlockNoise, one_hot, one_hot_rows, temperature_one_probs

#: A distribution [V] to draw from, or a token id when the draw is deterministic (greedy).
Draw = torch.Tensor | int


def acceptance_walk(
    num_tokens: int,
    accept_probability: torch.Tensor | Callable[[int], float],
    replacement: Callable[[int, bool], Draw],
    bonus: Callable[[], Draw],
    noise: BlockNoise | None,
    keep: Callable[[int, bool], bool] | None = None,
) -> tuple[int, int]:
    """(tokens kept, the next token).

    ``accept_probability``: [k] or a function of i (a rule whose later probabilities need a pass
    it only runs when the walk gets there, like VIA-SD's lazy full target). A probability of
    exactly 0 or 1 needs no coin (greedy walks run without noise).
    ``keep(i, passed)``: when given, decides from the coin's verdict ``passed`` whether x_i is
    kept (Judge Decoding ORs a second mask in); by default a token is kept iff it passed.
    ``replacement(i, passed)``: what to draw at the first position not kept.
    """
    for i in range(num_tokens):
        probability = float(accept_probability(i) if callable(accept_probability) else accept_probability[i])
        passed = coin_passes(probability, noise, i)
        if not (passed if keep is None else keep(i, passed)):
            return i, draw(replacement(i, passed), noise, i, residual=True)
    return num_tokens, draw(bonus(), noise, num_tokens, residual=False)


def coin_passes(probability: float, noise: BlockNoise | None, i: int) -> bool:
    """Whether the draft at block position i passes a test it passes with ``probability``: its
    keyed coin, so the verdict does not depend on which other positions were tested. A
    probability of exactly 0 or 1 needs no coin (greedy walks run without noise)."""
    return probability >= 1.0 or (probability > 0.0 and _needs(noise).coin(i) < probability)


def coin_verdicts(accept_probability: torch.Tensor, noise: BlockNoise | None) -> torch.Tensor:
    """``coin_passes`` at every position: probabilities [k] → bool [k] (a rule that combines the
    test's verdicts with another mask before deciding, like Judge Decoding)."""
    return torch.tensor([coin_passes(float(p), noise, i) for i, p in enumerate(accept_probability)], dtype=torch.bool)


def draw(what: Draw, noise: BlockNoise | None, i: int, residual: bool) -> int:
    """The token of a draw at block position i: a replacement (``residual``) with noise of its own,
    the bonus with the token noise. Without noise (greedy mode) only a token id or a one-hot
    distribution can be drawn."""
    if isinstance(what, int):
        return what
    if noise is not None:
        return noise.residual(i, what) if residual else noise.token(i, what)
    support = what.nonzero()
    if support.numel() != 1:
        raise TierspecError("a draw from a distribution needs the block's noise (sampling.BlockNoise); got None")
    return int(support)


def _needs(noise: BlockNoise | None) -> BlockNoise:
    if noise is None:
        raise TierspecError("an acceptance coin needs the block's noise (sampling.BlockNoise); got None")
    return noise


def draft_rows(proposal: Proposal, vocab_size: int) -> torch.Tensor:
    """p [k, V]: the drafter's sampling distributions, one-hot rows for a drafter without one."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs[:, :vocab_size]
    return one_hot_rows(proposal.tokens, vocab_size)


def draft_row(proposal: Proposal, i: int, vocab_size: int) -> torch.Tensor:
    """p_i [V] (one row of ``draft_rows`` without building the others)."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs[i, :vocab_size]
    return one_hot(int(proposal.tokens[i]), vocab_size)


def draft_prob_of_tokens(proposal: Proposal) -> torch.Tensor:
    """p_i(x_i) [k] (ones for a drafter without a distribution)."""
    k = len(proposal)
    if proposal.draft_probs is None:
        return torch.ones(k)
    return proposal.draft_probs[torch.arange(k), proposal.tokens]


def draft_confidence(proposal: Proposal) -> torch.Tensor | None:
    """max_v p(v) at temperature 1 [k], or None for a drafter with no distribution."""
    if proposal.draft_logits is None:
        return None
    return temperature_one_probs(proposal.draft_logits).max(-1).values
