"""BiLD, the big–little decoder (Kim et al. 2023), docs/algorithms.md §BiLD.

Fallback: drafting stops when the drafter's top probability falls below ``fallback`` (the
``policies.ConfidenceStop`` policy; see ``methods``). Rollback: the rule keeps the
longest prefix of draft tokens with −log q(x_i) ≤ ``rollback`` nats; at the first violation the
replacement is argmax q (greedy) or a draw from q. q is the target's sampling distribution
(temperature 1 in greedy mode, where the sampling distribution is one-hot).
"""

from __future__ import annotations

import math

import torch

from ..errors import TierspecError
from ..proposal import DRAFTER, TARGET, Proposal, Scores, Verdict
from ..sampling import BlockNoise, SamplingConfig, logits_to_probs, temperature_one_probs
from ..walks import acceptance_walk
from .base import ScoreRule


def bild_keep(target_prob_of_draft: torch.Tensor, rollback: float) -> torch.Tensor:
    """Which draft tokens pass the rollback test −log q(x) ≤ RB."""
    return target_prob_of_draft >= math.exp(-rollback)


class BildRule(ScoreRule):
    name = "bild"

    def __init__(self, rollback: float = 3.0):
        if math.isnan(rollback) or rollback < 0:
            raise TierspecError(f"rollback must be >= 0 nats, got {rollback}")
        self.rollback = rollback

    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        logits = scores.logits  # [k+1, V]
        k = len(proposal)
        q = logits_to_probs(logits, sampling)  # one-hot rows of argmax q in greedy mode
        # The rollback test reads q at temperature 1 in greedy mode, where q itself is one-hot.
        tested = temperature_one_probs(logits) if sampling.greedy else q
        keep = bild_keep(tested[torch.arange(k), proposal.tokens], self.rollback).float()
        walk = acceptance_walk(k, keep, lambda i, passed: q[i], lambda: q[k], noise)
        return Verdict(walk.path, walk.next_token, [DRAFTER] * walk.accepted + [TARGET])
