"""VIA-SD: three-tier hierarchical verification (docs/algorithms.md §VIA-SD).

Tiers: the drafter p, the slim verifier q' (the target under a DIMR routing mask, sharing
every weight), and the full target q, called lazily. Per position i, from temperature-1
distributions:

    δ1_i = 1[max p_i < 1 − α1]     drafter not confident → defer to q'
    δ2_i = 1[max q'_i < 1 − α2]    slim verifier not confident → defer to q
    π_i  = (1−δ2_i)·((1−δ1_i)·p_i + δ1_i·q'_i) + δ2_i·q_i

Cycle: one slim pass scores all k positions (+1). Walk i = 1..k: accept x_i with probability
min(1, π_i(x_i)/p_i(x_i)); on rejection draw from norm(max(0, π_i − p_i)) and end the block.
While δ2 = 0, π needs no q. At the first position with δ2 = 1 the full target runs once over
every committed token it has not processed plus the whole block, and the walk continues with
π = q wherever δ2 = 1. The bonus position k+1 has no draft (δ1 = 1). Blocks that never need
q are committed without a full-target call; ``max_target_lag`` caps how many committed
tokens the full target may leave unprocessed, so it runs at least that often.

With α1 = α2 = 0 and δ2 forced to 1 (``force_full``) the rule is exact speculative decoding.

``judge`` (VIA-SD + Judge Decoding, method ``via-judge``): where the full target decides
(δ2 = 1), a draft token the acceptance test rejects is still kept when the judge head, read
off the same full pass, accepts it (a per-position OR gate at the full-verifier tier).
In greedy mode each tier's distribution is the one-hot of its argmax.
"""

from __future__ import annotations

import math

import torch

from ..errors import TierspecError
from ..proposal import DRAFTER, JUDGE, SLIM, TARGET, Proposal, Verdict
from ..sampling import BlockNoise, SamplingConfig, logits_to_probs, residual_distribution, temperature_one_probs
from ..walks import acceptance_probability, acceptance_walk, draft_confidence, draft_rows
from .base import TieredRule, VerifierTiers
from .judge import judge_accepts


def via_gates(draft_confidence: torch.Tensor | None, slim_t1: torch.Tensor, alpha1: float, alpha2: float, k: int):
    """(δ1 [k], δ2 [k+1]) as bool tensors. A drafter with no distribution has δ1 = 1."""
    delta1 = torch.ones(k, dtype=torch.bool) if draft_confidence is None else draft_confidence < 1.0 - alpha1
    delta2 = slim_t1.max(-1).values < 1.0 - alpha2
    return delta1, delta2


def via_mixture(draft: torch.Tensor, slim: torch.Tensor, target: torch.Tensor | None, delta1: bool, delta2: bool) -> torch.Tensor:
    """π for one position; ``target`` may be None when δ2 = 0 (it is not needed)."""
    if delta2:
        return target
    return slim if delta1 else draft


class FullPass:
    """The full target's verdict on one block, computed at most once and only when the walk needs
    it: the first position with δ2 = 1 (or the lag cap) runs one full pass over every committed
    token the target has not processed plus the block. With a judge head, the same pass's hidden
    states give the judge's verdicts."""

    def __init__(self, tiers: VerifierTiers, proposal: Proposal, sampling: SamplingConfig, judge=None,
                 judge_threshold: float | None = None):
        self.tiers, self.proposal, self.sampling = tiers, proposal, sampling
        self.judge, self.judge_threshold = judge, judge_threshold
        self._probs: torch.Tensor | None = None  # q [k+1, V] once run
        self._judge_ok: torch.Tensor | None = None  # J [k] once run with a judge

    def probs(self) -> torch.Tensor:
        """q [k+1, V] under the sampling settings (runs the pass the first time)."""
        if self._probs is None:
            scores = self.tiers.target(self.proposal, with_hidden=self.judge is not None)
            if self.judge is not None:
                self._judge_ok = judge_accepts(self.judge, self.judge_threshold, scores.hidden, scores.logits,
                                               self.proposal.tokens)
            self._probs = logits_to_probs(scores.logits, self.sampling)
        return self._probs

    def judge_accepts(self, i: int) -> bool:
        """Whether the judge accepts draft i (False without a judge or before the pass ran: a
        position the full target decides always runs it first)."""
        return self._judge_ok is not None and bool(self._judge_ok[i])


class ViaRule(TieredRule):
    name = "via"

    def __init__(self, alpha1: float, alpha2: float, max_target_lag: int, force_full: bool = False,
                 judge=None, judge_threshold: float | None = None):
        """``max_target_lag``: most committed tokens the full target may leave unprocessed
        (``methods`` derives the default, 4γ, from the method's draft length)."""
        for name, value in (("alpha1", alpha1), ("alpha2", alpha2)):
            if math.isnan(value) or not 0.0 <= value <= 1.0:
                raise TierspecError(f"{name} must be in [0, 1], got {value}")
        if max_target_lag < 0:
            raise TierspecError(f"max_target_lag must be >= 0, got {max_target_lag}")
        self.alpha1, self.alpha2 = alpha1, alpha2
        self.max_target_lag = max_target_lag
        self.force_full = force_full
        self.judge = judge
        self.judge_threshold = None if judge is None else (judge.threshold if judge_threshold is None else judge_threshold)

    def verify(self, tiers: VerifierTiers, proposal: Proposal, sampling: SamplingConfig,
               noise: BlockNoise | None) -> Verdict:
        k = len(proposal)
        tokens = proposal.tokens
        slim_logits = tiers.slim(proposal).logits  # [k+1, V]
        vocab = slim_logits.shape[-1]
        delta1, delta2 = via_gates(draft_confidence(proposal), temperature_one_probs(slim_logits), self.alpha1, self.alpha2, k)
        if self.force_full:
            delta2 = torch.ones_like(delta2)
        p = draft_rows(proposal, vocab)  # [k, V]; one-hot rows in greedy mode
        slim = logits_to_probs(slim_logits, sampling)  # [k+1, V]
        full = FullPass(tiers, proposal, sampling, self.judge, self.judge_threshold)
        deciders: list[str] = []

        def pi(i: int) -> torch.Tensor:
            if i == k:  # bonus: no draft here, δ1 = 1
                return via_mixture(None, slim[k], full.probs()[k] if delta2[k] else None, True, bool(delta2[k]))
            return via_mixture(p[i], slim[i], full.probs()[i] if delta2[i] else None, bool(delta1[i]), bool(delta2[i]))

        def keep(i: int, passed: bool) -> bool:
            if passed:
                deciders.append(TARGET if delta2[i] else DRAFTER)
                return True
            if delta2[i] and full.judge_accepts(i):
                deciders.append(JUDGE)
                return True
            return False

        def tier(i: int) -> str:
            return TARGET if delta2[i] else SLIM

        # The cycle commits up to k+1 tokens: run the full pass now (the target catches up) if they
        # could push the lag past the cap.
        if tiers.target_lag + k + 1 > self.max_target_lag:
            full.probs()
        def accept(i: int) -> torch.Tensor:
            return acceptance_probability(p[i, tokens[i]], pi(i)[tokens[i]])

        walk = acceptance_walk(k, accept, lambda i, passed: residual_distribution(pi(i), p[i]), lambda: pi(k), noise, keep)
        return Verdict(walk.path, walk.next_token, deciders + [tier(walk.accepted)])

    @property
    def lossless(self) -> bool:
        return self.force_full
