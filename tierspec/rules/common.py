"""Shared pieces of the sampling-mode rules: one block walk driven by per-position
acceptance probabilities and lazily computed residuals."""

from __future__ import annotations

from typing import Callable

import torch

from ..drafters.base import Proposal
from ..sampling import one_hot, sample, temperature_one_probs, uniforms


def draft_rows(proposal: Proposal, vocab_size: int) -> torch.Tensor:
    """p [k, V]: the drafter's sampling distributions, one-hot rows for a drafter without one."""
    if proposal.draft_probs is not None:
        return proposal.draft_probs[:, :vocab_size]
    return torch.nn.functional.one_hot(proposal.tokens, vocab_size).float()


def draft_confidence(proposal: Proposal) -> torch.Tensor | None:
    """max_v p(v) at temperature 1 [k], or None for a drafter with no distribution."""
    if proposal.draft_logits is None:
        return None
    return temperature_one_probs(proposal.draft_logits).max(-1).values


def walk_block(
    draft_tokens: torch.Tensor,
    accept_probability: torch.Tensor,
    replacement: Callable[[int], torch.Tensor],
    bonus: Callable[[], torch.Tensor],
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Accept x_i with probability ``accept_probability[i]`` in order; at the first rejection
    draw from ``replacement(i)``; when all are kept draw the bonus from ``bonus()``."""
    k = int(draft_tokens.shape[0])
    coins = uniforms(k, generator)
    for i in range(k):
        if coins[i] >= accept_probability[i]:
            return i, sample(replacement(i), generator)
    return k, sample(bonus(), generator)


def onehot_like(token: int, row: torch.Tensor) -> torch.Tensor:
    return one_hot(token, row.shape[-1]).to(row.dtype)
