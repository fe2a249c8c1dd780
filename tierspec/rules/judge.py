"""Judge decoding (Bachmann et al. 2025), docs/algorithms.md §Judge decoding.

A linear head on the target's final hidden states gives, per drafted position, a judge
decision J_i = [sigmoid(logit) ≥ δ]; rule 3.1 gives SD_i with its own uniform draw. With
κ_SD and κ_J the numbers of leading SD and judge accepts, the block keeps x_1..x_κ,
κ = max(κ_SD, κ_J). Then one more token: if κ < γ, x_{κ+1} when SD_{κ+1} accepts it, else a
draw from norm(max(0, q − p)) there; if κ = γ, the bonus token from q. Greedy mode is the
same rule on one-hot rows of argmax q: SD_i iff x_i = argmax q_i, and the extra token is
argmax q at κ+1.

The head reads hidden states of the verification pass itself (one extra dot product per
position, no second forward): the rule declares it reads them (``reads_hidden``) and the loop's
one pass returns them. δ ≥ 1 disables the judge: exactly rule 3.1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads.judge import JudgeHead, judge_features
from ..proposal import DRAFTER, JUDGE, TARGET, Proposal, Scores, Verdict
from ..sampling import BlockNoise, SamplingConfig, logits_to_probs, residual_distribution
from ..walks import acceptance_probability, coin_verdicts, draft_prob_of_tokens, draft_row, draw, first_rejection
from .base import ScoreRule


def judge_accepts(head: JudgeHead, threshold: float, hidden: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """J [k] for draft ``tokens`` [k] from a verification pass's hidden [k+1, H] / logits [k+1, V]."""
    k = len(tokens)
    if threshold >= 1.0 or k == 0:
        return torch.zeros(k, dtype=torch.bool)
    features = judge_features(hidden[1 : k + 1], logits[:k], tokens, head.kind)
    return head.probability(features) >= threshold


@dataclass(frozen=True)
class JudgeBlock:
    """How far each mask keeps a block: ``plain`` = κ_SD leading acceptance-test passes,
    ``judged`` = κ_J leading judge accepts, ``kept`` = κ = max of the two."""

    plain: int
    judged: int

    @property
    def kept(self) -> int:
        return max(self.plain, self.judged)


def judge_block(sd_accepts: torch.Tensor, judge_ok: torch.Tensor) -> JudgeBlock:
    """The block's κ_SD and κ_J for the bool vectors SD [k] and J [k]."""
    return JudgeBlock(first_rejection(sd_accepts), first_rejection(judge_ok))


class JudgeRule(ScoreRule):
    name = "judge"
    reads_hidden = True

    def __init__(self, head: JudgeHead, threshold: float | None = None):
        self.head = head
        self.threshold = head.threshold if threshold is None else threshold

    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        tokens = proposal.tokens
        k = len(proposal)
        logits, hidden = scores.logits, scores.hidden  # [k+1, V], [k+1, H]
        q = logits_to_probs(logits, sampling)  # [k+1, V]; one-hot rows in greedy mode
        # SD_i for every position (keyed coins: testing a position the block never reaches
        # changes nothing); in greedy mode q(x)/p(x) is 1 iff x = argmax q, else 0.
        sd_accepts = coin_verdicts(acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens]),
                                   noise)
        block = judge_block(sd_accepts, judge_accepts(self.head, self.threshold, hidden, logits, tokens))
        kappa = block.kept
        if kappa == k:  # every draft kept: the bonus token from q
            token = draw(q[k], noise, k, residual=False)
        elif sd_accepts[kappa]:  # the judge's run outlasted SD's, and SD accepts x_{κ+1} on its own
            token = int(tokens[kappa])
        else:
            token = draw(residual_distribution(q[kappa], draft_row(proposal, kappa, q.shape[-1])), noise, kappa,
                         residual=True)
        return Verdict.chain(kappa, token, [DRAFTER] * block.plain + [JUDGE] * (kappa - block.plain) + [TARGET])

    @property
    def lossless(self) -> bool:
        return self.threshold >= 1.0
