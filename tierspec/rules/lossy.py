"""Lossy speculative decoding with tolerance (α, β), docs/algorithms.md §Lossy speculative decoding.

With z1(v) = log(1−α) + log p(v) − log q(v) and z2(v) = log β + log p(v) − log q(v):
accept x with probability min(1, q(x) / ((1−α)·p(x))) (outright when z1(x) ≤ 0); on
rejection draw from norm(max(0, q − β·p)), or from q when that is all zero. β defaults to
1 − α; α = 0, β = 1 is exact speculative decoding. Greedy: accept iff
q(x) ≥ (1−α)·max_v q(v) (q at temperature 1); the replacement is argmax q.
"""

from __future__ import annotations

import math

import torch

from ..errors import TierspecError
from ..proposal import DRAFTER, TARGET, Proposal, Scores, Verdict
from ..sampling import BlockNoise, SamplingConfig, logits_to_probs, residual_distribution, temperature_one_probs
from ..walks import acceptance_walk, draft_prob_of_tokens, draft_row
from .base import ScoreRule


def lossy_acceptance(draft_prob: torch.Tensor, target_prob: torch.Tensor, alpha: float) -> torch.Tensor:
    """min(1, q(x) / ((1−α)·p(x)))."""
    return torch.clamp(target_prob / ((1.0 - alpha) * draft_prob), max=1.0)


class LossyRule(ScoreRule):
    name = "lossy"

    def __init__(self, alpha: float = 0.1, beta: float | None = None):
        if math.isnan(alpha) or not 0.0 <= alpha < 1.0:
            raise TierspecError(f"alpha must be in [0, 1), got {alpha}")
        beta = 1.0 - alpha if beta is None else beta
        if math.isnan(beta) or not 0.0 < beta <= 1.0:
            raise TierspecError(f"beta must be in (0, 1], got {beta}")
        self.alpha, self.beta = alpha, beta

    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        logits = scores.logits  # [k+1, V]
        tokens = proposal.tokens
        k = len(proposal)
        q = logits_to_probs(logits, sampling)  # [k+1, V]; one-hot rows of argmax q in greedy mode
        if sampling.greedy:  # the greedy test reads q at temperature 1 (a one-hot q would make it exact)
            t1 = temperature_one_probs(logits[:k])
            accept = (t1[torch.arange(k), tokens] >= (1.0 - self.alpha) * t1.max(-1).values).float()
        else:
            accept = lossy_acceptance(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens], self.alpha)
        # Greedy mode: a rejected x is not argmax q, so the residual of one-hot rows is argmax q.
        walk = acceptance_walk(
            k, accept, lambda i, passed: residual_distribution(q[i], draft_row(proposal, i, q.shape[-1]), self.beta),
            lambda: q[k], noise)
        return Verdict(walk.path, walk.next_token, [DRAFTER] * walk.accepted + [TARGET])

    @property
    def lossless(self) -> bool:
        return self.alpha == 0.0 and self.beta == 1.0
