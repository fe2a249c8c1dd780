"""Judge decoding (Bachmann et al. 2025), DESIGN §3.7.

A linear head on the target's final hidden states gives, per drafted position, a judge
decision J_i = [sigmoid(logit) ≥ δ]; rule 3.1 gives SD_i with its own uniform draw. With
κ_SD and κ_J the numbers of leading SD and judge accepts, the block keeps x_1..x_κ,
κ = max(κ_SD, κ_J). Then one more token: if κ < γ, x_{κ+1} when SD_{κ+1} accepts it, else a
draw from norm(max(0, q − p)) there; if κ = γ, the bonus token from q. Greedy: SD_i iff
x_i = argmax q_i, and the extra token is argmax q at κ+1.

The head reads hidden states of the verification pass itself (one extra dot product per
position, no second forward). δ ≥ 1 disables the judge: exactly rule 3.1.
"""

from __future__ import annotations

import torch

from ..judge.head import JudgeHead, judge_features
from ..sampling import logits_to_probs, residual_distribution, sample, uniforms
from .base import DRAFTER, TARGET, Verdict, VerificationRule
from .common import draft_rows
from .exact import acceptance_probability, first_rejection

JUDGE = "judge"  # tier label: a token plain verification rejected and the judge accepted


def judge_accepts(head: JudgeHead, threshold: float, hidden: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """J [k] for draft ``tokens`` [k] from a verification pass's hidden [k+1, H] / logits [k+1, V]."""
    k = len(tokens)
    if threshold >= 1.0 or k == 0:
        return torch.zeros(k, dtype=torch.bool)
    features = judge_features(hidden[1 : k + 1], logits[:k], tokens, head.kind)
    return head.probability(features) >= threshold


def judge_block(sd_accepts: torch.Tensor, judge_ok: torch.Tensor) -> tuple[int, int, int]:
    """(κ_SD, κ_J, κ = max of the two) for the bool vectors SD [k] and J [k]."""
    kappa_sd, kappa_j = first_rejection(sd_accepts), first_rejection(judge_ok)
    return kappa_sd, kappa_j, max(kappa_sd, kappa_j)


class JudgeRule(VerificationRule):
    name = "judge"

    def __init__(self, head: JudgeHead, threshold: float | None = None):
        self.head = head
        self.threshold = head.threshold if threshold is None else threshold

    def verify(self, verifiers, proposal, sampling, generator) -> Verdict:
        tokens = proposal.tokens
        k = len(proposal)
        logits, hidden = verifiers.target_logits(tokens, with_hidden=True)
        judge_ok = judge_accepts(self.head, self.threshold, hidden, logits, tokens)
        if sampling.greedy:
            best = logits.argmax(-1)
            sd = tokens == best[:k]
        else:
            q = logits_to_probs(logits, sampling)
            p = draft_rows(proposal, q.shape[-1])
            rows = torch.arange(k)
            sd = uniforms(k, generator) < acceptance_probability(p[rows, tokens], q[rows, tokens])
        kappa_sd, _, kappa = judge_block(sd, judge_ok)
        if kappa == k:
            token = int(best[k]) if sampling.greedy else sample(q[k], generator)
        elif sd[kappa]:
            token = int(tokens[kappa])
        else:
            token = int(best[kappa]) if sampling.greedy else sample(residual_distribution(q[kappa], p[kappa]), generator)
        deciders = [DRAFTER if i < kappa_sd else JUDGE for i in range(kappa)] + [TARGET]
        return Verdict(kappa, token, deciders)

    @property
    def lossless(self) -> bool:
        return self.threshold >= 1.0
