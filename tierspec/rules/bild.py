"""BiLD, the big–little decoder (Kim et al. 2023), DESIGN §3.3.

Fallback: the drafter stops drafting when its top probability falls below ``fallback``
(the drafter's ``confidence_threshold``; see ``methods``). Rollback: the rule keeps the
longest prefix of draft tokens with −log q(x_i) ≤ ``rollback`` nats; at the first violation the
replacement is argmax q (greedy) or a draw from q. q is the target's sampling distribution
(temperature 1 in greedy mode, where the sampling distribution is one-hot).
"""

from __future__ import annotations

import math

import torch

from ..sampling import logits_to_probs, sample, temperature_one_probs
from .base import DRAFTER, TARGET, Verdict, VerificationRule
from .exact import first_rejection


def bild_keep(target_prob_of_draft: torch.Tensor, rollback: float) -> torch.Tensor:
    """Which draft tokens pass the rollback test −log q(x) ≤ RB."""
    return target_prob_of_draft >= math.exp(-rollback)


class BildRule(VerificationRule):
    name = "bild"

    def __init__(self, rollback: float = 3.0):
        if rollback < 0:
            raise ValueError(f"rollback must be >= 0 nats, got {rollback}")
        self.rollback = rollback

    def verify(self, verifiers, proposal, sampling, generator) -> Verdict:
        logits = verifiers.target_logits(proposal.tokens)
        k = len(proposal)
        q = temperature_one_probs(logits) if sampling.greedy else logits_to_probs(logits, sampling)
        accepted = first_rejection(bild_keep(q[torch.arange(k), proposal.tokens], self.rollback))
        token = int(logits[accepted].argmax()) if sampling.greedy else sample(q[accepted], generator)
        return Verdict(accepted, token, [DRAFTER] * accepted + [TARGET])
