"""Cost-aware draft length: draft the number of tokens that maximises expected tokens per second.

On a CPU verification is not free (a target pass over 1 / 6 / 8 new tokens costs about
46 / 80 / 91 ms on the default model), so a fixed long draft wastes time whenever acceptance
is low, and a fixed short one leaves speed behind when it is high. This wrapper keeps two
online estimates and picks k each cycle:

* cost: the measured cycle time as a function of k, t(k) ≈ a + b·k (a least-squares fit over
  exponentially weighted per-k averages of observed cycles, so drafting cost, verification
  cost and the loop's own overhead are all in it);
* acceptance: a per-token acceptance probability α, modelled as geometric (each drafted token
  is accepted with probability α given the previous one was), estimated per *context* of the
  proposal (a memory of about ten blocks; a new prompt keeps a quarter of the evidence) — for n-gram lookup the size of the matched n-gram, a strong predictor — from
  exponentially decayed success / failure counts with a Beta(1, 1) prior, and separately after
  a fully accepted block and after a rejection (acceptance runs in streaks: a copied passage
  tends to keep being copied).

Expected tokens emitted by a block of k drafts: E(k) = (1 − α^{k+1}) / (1 − α) (the +1 is the
correction or bonus token). The chosen k maximises E(k) / t(k), k = 0 (plain decoding)
included. Estimates whose key was not drafted for a while drift back to the prior, so a
context written off early is tried again.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .base import Drafter, Proposal
from .ngram import NgramDrafter


def expected_tokens(alpha: float, k: int) -> float:
    """E[emitted] for k drafts with geometric per-token acceptance α (correction/bonus included)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_length(alpha: float, cost, max_k: int) -> int:
    """argmax_k E(k) / cost(k) over k = 0 .. max_k (ties → shorter)."""
    best_k, best_rate = 0, expected_tokens(alpha, 0) / cost(0)
    for k in range(1, max_k + 1):
        rate = expected_tokens(alpha, k) / cost(k)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


class CycleCostModel:
    """t(k) = a + b·k from observed (k, seconds).

    Robust to a shared, noisy machine: an observation is clipped to [½, 2]× the current
    prediction before it enters the per-k averages, every observation ages all others (so
    lengths that are no longer drafted fade), and the slope is shrunk toward the prior
    b = ``prior_ratio``·a with the weight of ``prior_weight`` observations, so a length
    written off on stale or noisy data is tried again.
    """

    def __init__(self, decay: float = 0.95, prior_ratio: float = 0.15, prior_weight: float = 3.0, prior=None):
        """``prior``: k → seconds of the verification pass alone (a measured forward-cost
        table, ``costs.ForwardCosts``); it is scaled online by the observed/prior ratio (which
        absorbs drafting and loop overhead) and blended with per-k observations."""
        self.decay, self.prior_ratio, self.prior_weight = decay, prior_ratio, prior_weight
        self.prior = prior
        self.scale = 1.0
        self.scale_weight = 0.0
        self.mean: dict[int, float] = {}
        self.weight: dict[int, float] = defaultdict(float)

    def observe(self, k: int, seconds: float) -> None:
        if self.mean:
            predicted = self(k)
            seconds = min(max(seconds, 0.5 * predicted), 2.0 * predicted)
        for key in self.weight:
            self.weight[key] *= self.decay
        if self.prior is not None:
            self.scale_weight = self.scale_weight * self.decay + 1.0
            self.scale += (seconds / self.prior(k) - self.scale) / self.scale_weight
        w = self.weight[k]
        self.mean[k] = (self.mean.get(k, seconds) * w + seconds) / (w + 1.0)
        self.weight[k] = w + 1.0

    def coefficients(self) -> tuple[float, float]:
        if not self.mean:
            return 1.0, self.prior_ratio
        ks = list(self.mean)
        w = torch.tensor([self.weight[k] for k in ks], dtype=torch.float64)
        x = torch.tensor(ks, dtype=torch.float64)
        y = torch.tensor([self.mean[k] for k in ks], dtype=torch.float64)
        xm, ym = float((w * x).sum() / w.sum()), float((w * y).sum() / w.sum())
        var = float((w * (x - xm) ** 2).sum())
        fitted = float((w * (x - xm) * (y - ym)).sum()) / var if var > 0 else 0.0
        # Prior slope relative to the intercept implied at the observed mean length.
        prior = self.prior_ratio * ym / (1.0 + self.prior_ratio * xm)
        evidence = float((w * (x - xm) ** 2).sum()) / max((x - xm).abs().max().item(), 1.0) ** 2 if var > 0 else 0.0
        b = (fitted * evidence + prior * self.prior_weight) / (evidence + self.prior_weight)
        b = max(b, 1e-3 * ym)  # a longer block never costs less
        a = max(ym - b * xm, 1e-9)
        return a, b

    def __call__(self, k: int) -> float:
        if self.prior is None:
            a, b = self.coefficients()
            return a + b * k
        base = self.prior(k) * self.scale
        if k not in self.mean:
            return base
        w = self.weight[k]
        return (self.mean[k] * w + base * self.prior_weight) / (w + self.prior_weight)


class AcceptanceEstimate:
    """Geometric per-token acceptance with decayed counts and a Beta(1, 1) prior."""

    def __init__(self, decay: float = 0.9, idle_decay: float = 0.99):
        self.decay, self.idle_decay = decay, idle_decay
        self.successes = 0.0
        self.failures = 0.0

    @property
    def alpha(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)

    def observe(self, drafted: int, accepted: int) -> None:
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1.0 if accepted < drafted else 0.0)

    def idle(self) -> None:
        self.successes *= self.idle_decay
        self.failures *= self.idle_decay

    def shrink(self, factor: float) -> None:
        """Keep only ``factor`` of the evidence (a new prompt may be a new regime)."""
        self.successes *= factor
        self.failures *= factor


class CostAwareDrafter(Drafter):
    """Wraps a drafter and chooses its draft length per cycle (see the module docstring)."""

    def __init__(self, inner: Drafter, max_draft: int = 10, cost=None, forward_costs=None):
        """``cost``: a fixed cycle-cost function k → seconds instead of the one learned from this
        machine's cycle times. ``forward_costs``: the target's measured forward-cost table
        (``costs.ForwardCosts``), the learned model's prior for a verification of k + 1 tokens."""
        self.inner = inner
        self.max_draft = max_draft
        self.learn_cost = cost is None
        prior = None if forward_costs is None else (lambda k: forward_costs.cost(k + 1))
        self.costs = CycleCostModel(prior=prior) if cost is None else cost
        self.acceptance: dict[object, AcceptanceEstimate] = defaultdict(AcceptanceEstimate)
        self._pending_key = None
        self._streak = False  # was the last drafted block fully accepted?
        self.calls = 0

    def start(self, prompt_ids, verifiers) -> None:
        # Costs carry over between generations (same machine, same model). Acceptance is a
        # property of the text: a summary copies far less than a translation or code edit, so
        # a new prompt keeps only a quarter of the acceptance evidence as its prior.
        self.inner.start(prompt_ids, verifiers)
        for estimate in self.acceptance.values():
            estimate.shrink(0.25)
        self._streak = False
        self.calls = 0

    def _choose(self, key, max_k: int) -> int:
        k = best_draft_length(self.acceptance[key].alpha, self.costs, max_k)
        if k == 0:
            self.acceptance[key].idle()
        return k

    def propose(self, context, num_tokens, sampling, generator) -> Proposal:
        cap = min(num_tokens, self.max_draft)
        if cap <= 0:
            self._pending_key = None
            return Proposal.empty()
        if isinstance(self.inner, NgramDrafter):
            found = self.inner.lookup(context.numpy(), cap)
            key = ("ngram", self.inner.last_match_size, self._streak)
            k = self._choose(key, len(found)) if len(found) else 0
            self._pending_key = key if k else None
            return Proposal(torch.from_numpy(found[:k].copy()).long()) if k else Proposal.empty()
        key = ("model", self._streak)
        k = self._choose(key, cap)
        self._pending_key = key if k else None
        proposal = self.inner.propose(context, k, sampling, generator) if k else Proposal.empty()
        self.calls = self.inner.calls
        return proposal

    def commit(self, committed_length: int) -> None:
        self.inner.commit(committed_length)

    def observe(self, cycle) -> None:
        if self.learn_cost:
            self.costs.observe(cycle.drafted, cycle.seconds)
        if self._pending_key is not None and cycle.drafted:
            self.acceptance[self._pending_key].observe(cycle.drafted, cycle.accepted)
            self._streak = cycle.accepted == cycle.drafted
        self.inner.observe(cycle)
