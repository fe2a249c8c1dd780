"""The one acceptance walk every verification rule uses, and the draft rows it reads.

A rule supplies, per drafted position i, the probability of keeping x_i (for the mixture rules
min(1, π_i(x_i)/p_i(x_i))), the distribution to draw from when x_i is not kept (its residual
norm(max(0, π_i − p_i))), and the bonus distribution after a fully kept block. The walk keeps
x_1, x_2, … in order and ends the block at the first token not kept (DESIGN §3). Greedy mode is
the same walk over one-hot distributions; a deterministic replacement may be given as a token id.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..drafters.base import Proposal
from ..sampling import one_hot, one_hot_rows, sample, temperature_one_probs, uniforms

#: A distribution [V] to draw from, or a token id when the draw is deterministic (greedy).
Draw = torch.Tensor | int


def acceptance_walk(
    num_tokens: int,
    accept_probability: torch.Tensor | Callable[[int], float],
    replacement: Callable[[int, bool], Draw],
    bonus: Callable[[], Draw],
    generator: torch.Generator | None,
    keep: Callable[[int, bool], bool] | None = None,
) -> tuple[int, int]:
    """(tokens kept, the next token).

    ``accept_probability``: [k] or a function of i (a rule whose later probabilities need a pass
    it only runs when the walk gets there, like VIA-SD's lazy full target).
    ``keep(i, passed)``: when given, decides from the coin's verdict ``passed`` whether x_i is
    kept (Judge Decoding ORs a second mask in); by default a token is kept iff it passed.
    ``replacement(i, passed)``: what to draw at the first position not kept.
    """
    coins = uniforms(num_tokens, generator) if num_tokens else None
    for i in range(num_tokens):
        probability = accept_probability(i) if callable(accept_probability) else accept_probability[i]
        passed = bool(coins[i] < probability)
        if not (passed if keep is None else keep(i, passed)):
            return i, _draw(replacement(i, passed), generator)
    return num_tokens, _draw(bonus(), generator)


def _draw(what: Draw, generator: torch.Generator | None) -> int:
    return what if isinstance(what, int) else sample(what, generator)


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
