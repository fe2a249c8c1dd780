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
from ..sampling import logits_to_probs, residual_distribution
from .base import DRAFTER, TARGET, Verdict, VerificationRule
from .common import acceptance_walk, draft_prob_of_tokens, draft_row
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

    def verify(self, verifiers, proposal, sampling, noise) -> Verdict:
        tokens = proposal.tokens
        k = len(proposal)
        logits, hidden = verifiers.target_logits(tokens, with_hidden=True)
        judge_ok = judge_accepts(self.head, self.threshold, hidden, logits, tokens)
        if sampling.greedy:
            best = logits.argmax(-1)
            sd_probability = (tokens == best[:k]).float()
            # SD accepting x at the last position means x is argmax q: the same token either way.
            replacement = lambda i, passed: int(best[i])  # noqa: E731
            bonus = lambda: int(best[k])  # noqa: E731
        else:
            q = logits_to_probs(logits, sampling)
            vocab = q.shape[-1]
            sd_probability = acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens])
            replacement = lambda i, passed: int(tokens[i]) if passed else residual_distribution(q[i], draft_row(proposal, i, vocab))  # noqa: E731
            bonus = lambda: q[k]  # noqa: E731
        alive = {"sd": True, "judge": True, "kappa_sd": k}

        def keep(i: int, passed: bool) -> bool:
            # x_i is kept while either mask accepts the whole prefix (κ = max(κ_SD, κ_J)).
            if alive["sd"] and not passed:
                alive["sd"], alive["kappa_sd"] = False, i
            alive["judge"] = alive["judge"] and bool(judge_ok[i])
            return alive["sd"] or alive["judge"]

        kappa, token = acceptance_walk(k, sd_probability, replacement, bonus, noise, keep)
        kappa_sd = min(alive["kappa_sd"], kappa)
        deciders = [DRAFTER if i < kappa_sd else JUDGE for i in range(kappa)] + [TARGET]
        return Verdict(kappa, token, deciders)

    @property
    def lossless(self) -> bool:
        return self.threshold >= 1.0
