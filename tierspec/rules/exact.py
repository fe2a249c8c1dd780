"""Exact (lossless) speculative decoding (Leviathan et al. 2023; Chen et al. 2023), DESIGN §3.1.

Accept a drafted x with probability min(1, q(x)/p(x)); on rejection draw from
norm(max(0, q − p)). The emitted token is then distributed exactly as q. A drafter with no
distribution (n-gram) counts as one-hot p, so x is accepted with probability q(x).
Greedy: accept iff x = argmax q; the replacement is argmax q.
"""

from __future__ import annotations

import torch

from ..sampling import SamplingConfig, logits_to_probs, residual_distribution
from .base import DRAFTER, TARGET, Verdict, VerificationRule
from .common import acceptance_walk, draft_prob_of_tokens, draft_row


def acceptance_probability(draft_prob: torch.Tensor, target_prob: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) elementwise; p(x) > 0 for any token the drafter drew."""
    return torch.clamp(target_prob / draft_prob, max=1.0)


def first_rejection(accept: torch.Tensor) -> int:
    """Index of the first False in the bool vector ``accept`` [k] (k when all are True)."""
    rejected = (~accept).nonzero()
    return int(rejected[0]) if rejected.numel() else int(accept.shape[0])


def exact_walk(proposal, target_logits: torch.Tensor, sampling: SamplingConfig, generator) -> tuple[int, int]:
    """Rule 3.1 on target logits [k+1, V] → (accepted, next token)."""
    tokens = proposal.tokens
    k = len(tokens)
    vocab = target_logits.shape[-1]
    if sampling.greedy:
        best = target_logits.argmax(-1)  # [k+1]
        return acceptance_walk(k, (tokens == best[:k]).float(), lambda i, passed: int(best[i]), lambda: int(best[k]), generator)
    q = logits_to_probs(target_logits, sampling)  # [k+1, V]
    accept = acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens])
    return acceptance_walk(k, accept, lambda i, passed: residual_distribution(q[i], draft_row(proposal, i, vocab)),
                           lambda: q[k], generator)


class ExactRule(VerificationRule):
    """Lossless verification against the full target (with an empty draft: plain decoding)."""

    name = "exact"

    def verify(self, verifiers, proposal, sampling: SamplingConfig, generator) -> Verdict:
        target_logits = verifiers.target_logits(proposal.tokens)  # [k+1, V]
        accepted, token = exact_walk(proposal, target_logits, sampling, generator)
        return Verdict(accepted, token, [DRAFTER] * accepted + [TARGET])

    @property
    def lossless(self) -> bool:
        return True
