"""Speculative cascades (Faster Cascades, Narasimhan et al. 2024), docs/algorithms.md §Speculative
cascades.

Per position a deferral bit δ picks the target mixture π = (1−δ)·p + δ·q:
    chow: δ = 1[max p < 1−α]
    diff: δ = 1[max p < max q − α]
    opt:  δ = 1[max p < max q − α·TV(p, q)]
    always: δ = 1 (exact speculative decoding)
Accept x with probability min(1, π(x)/p(x)); on rejection draw from norm(max(0, π − p)).
Deferral bits use the temperature-1 distributions. In greedy mode each tier's distribution is
the one-hot of its argmax. A drafter with no distribution (n-gram) always defers (δ = 1).
The bonus after a fully accepted block is drawn from q: the drafter has no distribution for
position k+1, so δ = 1 there.
"""

from __future__ import annotations

import torch

from ..errors import TierspecError
from ..proposal import DRAFTER, TARGET, Proposal, Scores, Verdict
from ..sampling import BlockNoise, SamplingConfig, logits_to_probs, residual_distribution, temperature_one_probs
from ..walks import acceptance_probability, acceptance_walk, draft_rows
from .base import ScoreRule

DEFERRALS = ("chow", "diff", "opt", "always")


def deferral_bits(draft_t1: torch.Tensor | None, target_t1: torch.Tensor, rule: str, alpha: float) -> torch.Tensor:
    """δ [k] from temperature-1 distributions p [k, V] (None: no distribution) and q [k, V]."""
    k = target_t1.shape[0]
    if draft_t1 is None or rule == "always":
        return torch.ones(k, dtype=torch.bool)
    max_p = draft_t1.max(-1).values
    if rule == "chow":
        return max_p < 1.0 - alpha
    max_q = target_t1.max(-1).values
    if rule == "diff":
        return max_p < max_q - alpha
    if rule == "opt":
        total_variation = 0.5 * (draft_t1 - target_t1).abs().sum(-1)
        return max_p < max_q - alpha * total_variation
    raise TierspecError(f"unknown deferral rule '{rule}'; choose one of: {', '.join(DEFERRALS)}")


def mixture(draft: torch.Tensor, target: torch.Tensor, defer: torch.Tensor) -> torch.Tensor:
    """π = (1−δ)·p + δ·q rowwise."""
    d = defer.to(target.dtype).unsqueeze(-1)
    return (1 - d) * draft + d * target


class SpeculativeCascadeRule(ScoreRule):
    name = "cascade"

    def __init__(self, deferral: str = "opt", alpha: float = 0.1):
        if deferral not in DEFERRALS:
            raise TierspecError(f"unknown deferral rule '{deferral}'; choose one of: {', '.join(DEFERRALS)}")
        self.deferral, self.alpha = deferral, alpha

    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        logits = scores.logits  # [k+1, V]
        k = len(proposal)
        vocab = logits.shape[-1]
        draft_t1 = None if proposal.logits is None else temperature_one_probs(proposal.draft_logits[:, :vocab])
        defer = deferral_bits(draft_t1, temperature_one_probs(logits[:k]), self.deferral, self.alpha)
        # In greedy mode both are one-hot rows (the sampling distribution at temperature 0), so
        # the walk keeps x iff the selected tier's argmax is x.
        q = logits_to_probs(logits, sampling)
        p = draft_rows(proposal, vocab)
        pi = mixture(p, q[:k], defer)
        rows = torch.arange(k)
        accept = acceptance_probability(p[rows, proposal.tokens], pi[rows, proposal.tokens])
        walk = acceptance_walk(k, accept, lambda i, passed: residual_distribution(pi[i], p[i]), lambda: q[k], noise)
        deciders = [DRAFTER if not defer[i] else TARGET for i in range(walk.accepted)] + [TARGET]
        return Verdict(walk.path, walk.next_token, deciders)
