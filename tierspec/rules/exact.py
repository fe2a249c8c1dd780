"""Exact (lossless) speculative decoding (Leviathan et al. 2023; Chen et al. 2023), DESIGN §3.1.

Accept a drafted x with probability min(1, q(x)/p(x)); on rejection draw from
norm(max(0, q − p)). The emitted token is then distributed exactly as q. A drafter with no
distribution (n-gram) counts as one-hot p, so x is accepted with probability q(x).
Greedy: accept iff x = argmax q; the replacement is argmax q.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingConfig, logits_to_probs, residual_distribution, sample, uniforms
from .base import DRAFTER, TARGET, Verdict, VerificationRule


def acceptance_probability(draft_prob: torch.Tensor, target_prob: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) elementwise; p(x) > 0 for any token the drafter drew."""
    return torch.clamp(target_prob / draft_prob, max=1.0)


def first_rejection(accept: torch.Tensor) -> int:
    """Index of the first False in the bool vector ``accept`` [k] (k when all are True)."""
    rejected = (~accept).nonzero()
    return int(rejected[0]) if rejected.numel() else int(accept.shape[0])


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy rule on target logits [k+1, V] → (accepted, next token)."""
    best = target_logits.argmax(-1)  # [k+1]
    k = int(draft_tokens.shape[0])
    accepted = first_rejection(draft_tokens == best[:k])
    return accepted, int(best[accepted])


def sampled_verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Sampling rule. draft_probs [k, V] or None (one-hot), target_probs [k+1, V]."""
    k = int(draft_tokens.shape[0])
    rows = torch.arange(k)
    q_x = target_probs[rows, draft_tokens]
    p_x = torch.ones(k) if draft_probs is None else draft_probs[rows, draft_tokens]
    accept = uniforms(k, generator) < acceptance_probability(p_x, q_x)
    accepted = first_rejection(accept)
    if accepted == k:
        return k, sample(target_probs[k], generator)
    if draft_probs is None:
        p_row = torch.zeros_like(target_probs[accepted])
        p_row[draft_tokens[accepted]] = 1.0
    else:
        p_row = draft_probs[accepted]
    return accepted, sample(residual_distribution(target_probs[accepted], p_row), generator)


class ExactRule(VerificationRule):
    """Lossless verification against the full target (with an empty draft: plain decoding)."""

    name = "exact"

    def verify(self, verifiers, proposal, sampling: SamplingConfig, generator) -> Verdict:
        target_logits = verifiers.target_logits(proposal.tokens)  # [k+1, V]
        if sampling.greedy:
            accepted, token = greedy_verify(proposal.tokens, target_logits)
        else:
            target_probs = logits_to_probs(target_logits, sampling)
            accepted, token = sampled_verify(proposal.tokens, proposal.draft_probs, target_probs, generator)
        return Verdict(accepted, token, [DRAFTER] * accepted + [TARGET])

    @property
    def lossless(self) -> bool:
        return True
