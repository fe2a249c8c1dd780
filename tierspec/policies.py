"""Draft-length policies: how many drafted tokens each cycle sends to verification.

A policy is passed into the decode loop beside the drafter (docs/algorithms.md §The decode loop);
drafters only propose. Per cycle the loop

1. gives the drafter ``policy.max_draft`` as its budget (capped by the tokens left) and
   ``policy.keep_drafting`` as the callback a drafting model asks after each token,
2. cuts the proposal to ``policy.trim(proposal)`` tokens,
3. after verification reports the outcome (``observe``): per drafted position whether it was
   accepted, rejected or never evaluated.

No policy reads the clock or keeps what it learned from one generation to the next (``start``
resets it): a draft length is a function of the method's settings, its pass-cost table and the
verdicts of the generation so far, so the seed fixes the drafts and, through them, the text of
every rule whose verdicts depend on the drafts (README: "Same seed, same text").

Policies:

* ``FixedLength(γ)``: always γ tokens (when the drafter has them).
* ``ConfidenceStop(γ, threshold)``: stop at the first drafted token whose top probability at
  temperature 1 is below ``threshold`` (self-speculative drafting's early stop; BiLD's fallback).
* ``CostAware(max_draft, ...)``: the length that maximises expected emitted tokens per second,
  from the measured cost of a verification pass per number of tokens, the cost of a drafter's
  step (a fixed fraction of a pass), and acceptance probabilities learned online from every
  verdict of the generation (per position, keyed by what the drafter knew: the n-gram match
  size, or the draft confidence).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from .errors import TierspecError


class DraftPolicyError(TierspecError):
    """Invalid policy settings."""


# Coarse on purpose: each bin × first/later is learned on its own, and a generation is short.
CONFIDENCE_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.01)


def confidence_bin(confidence: float) -> int:
    return max(i for i, edge in enumerate(CONFIDENCE_BINS[:-1]) if confidence >= edge)


@dataclass(frozen=True)
class MatchKey:
    """The acceptance context of a token an n-gram lookup copied: the size of the n-gram it
    matched (``Proposal.match_sizes``) and whether the previous block was accepted whole (copying
    runs in streaks)."""

    source: str
    match_size: int
    streak: bool

    prior = 0.5


@dataclass(frozen=True)
class ConfidenceKey:
    """The acceptance context of a token drawn from a distribution: its confidence bin (top
    probability at temperature 1, ``CONFIDENCE_BINS``) and whether it is the block's first token
    (a drafter's first token of a block and its later ones, whose predecessors were accepted, are
    accepted at different rates even at the same confidence: 0.52 vs 0.75 for the second
    position, measured on the draft head). No streak flag: the confidence already says what it
    would."""

    source: str
    confidence_bin: int
    first: bool

    @property
    def prior(self) -> float:
        """The middle of the bin: a token drafted at confidence c is accepted about c of the time."""
        low, high = CONFIDENCE_BINS[self.confidence_bin], min(CONFIDENCE_BINS[self.confidence_bin + 1], 1.0)
        return (low + high) / 2


@dataclass(frozen=True)
class SourceKey:
    """The acceptance context of a token its drafter gave no reason or distribution for: the
    drafter and the previous block's streak."""

    source: str
    streak: bool

    prior = 0.5


AcceptanceKey = MatchKey | ConfidenceKey | SourceKey


@dataclass
class CycleOutcome:
    """What the loop tells a policy after each verdict."""

    keys: list[AcceptanceKey | None]  # per drafted token: the acceptance context the policy used
    accepted: int  # leading drafted tokens kept
    drafted: int
    source: str = ""  # which drafter proposed (a hybrid drafter has several)
    # The first drafted token the policy cut off, when the verdict tells whether it would have
    # been accepted: after a fully accepted block, the target's bonus token is its verdict (exact
    # in greedy mode; in sampling mode "bonus == token" is a conservative stand-in). Without it a
    # policy that stops drafting a kind of token would never learn that it should not have.
    cut_key: AcceptanceKey | None = None
    cut_accepted: bool | None = None


class DraftPolicy:
    """Base class: a fixed budget, no early stop, no trimming."""

    max_draft: int = 0

    def start(self) -> None:
        """A new generation begins: forget what earlier generations taught (a server's method
        serves many requests; a seed must give the same drafts whatever ran before)."""

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        """Asked by a drafting model (``source``) after each drafted token, with the top
        probability at temperature 1 of every token drafted so far: draft another one?"""
        return True

    def trim(self, proposal) -> int:
        """How many leading tokens of ``proposal`` to verify (a pure choice: a policy learns only
        in ``observe``)."""
        return len(proposal)

    def keys(self, proposal, count: int) -> list[AcceptanceKey | None]:
        """The acceptance context of each of the first ``count`` tokens (for ``observe``); None
        for a policy that learns nothing."""
        return [None] * count

    def observe(self, outcome: CycleOutcome) -> None:
        """Learn from a verdict."""


def _check_length(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DraftPolicyError(f"{name} must be an integer >= 0, got {value!r}")
    return value


class FixedLength(DraftPolicy):
    """Draft γ tokens every cycle (0 = plain decoding)."""

    def __init__(self, num_draft: int):
        self.max_draft = _check_length("num_draft", num_draft)


class ConfidenceStop(DraftPolicy):
    """Up to γ tokens, cut before the first token the drafter was unsure of (top probability
    at temperature 1 below ``threshold``): such a token is likely rejected, and a drafting
    model pays a forward pass per token."""

    def __init__(self, num_draft: int, threshold: float):
        self.max_draft = _check_length("num_draft", num_draft)
        if not 0.0 <= threshold <= 1.0 or math.isnan(threshold):
            raise DraftPolicyError(f"the confidence threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        return confidences[-1] >= self.threshold

    def trim(self, proposal) -> int:
        confidence = proposal.confidence
        if confidence is None or self.threshold <= 0:
            return len(proposal)
        unsure = (confidence < self.threshold).nonzero()
        return int(unsure[0]) if unsure.numel() else len(proposal)


# ---- the cost-aware policy -------------------------------------------------------------------


def expected_emitted(reach: list[float]) -> list[float]:
    """E(k) for k = 0..n: expected tokens emitted by a block of k drafts, where ``reach[i]`` is
    the probability that drafts 1..i+1 are all accepted. E(k) = 1 + Σ_{i<k} reach[i] (the 1 is
    the correction or bonus token)."""
    out = [1.0]
    for r in reach:
        out.append(out[-1] + r)
    return out


def best_length(reach: list[float], cost) -> int:
    """argmax_k E(k) / cost(k) over k = 0 .. len(reach) (ties → shorter)."""
    emitted = expected_emitted(reach)
    best_k, best_rate = 0, emitted[0] / cost(0)
    for k in range(1, len(emitted)):
        rate = emitted[k] / cost(k)
        if rate > best_rate * (1 + 1e-9):
            best_k, best_rate = k, rate
    return best_k


@dataclass
class AcceptanceEstimate:
    """P(a drafted token is accepted | the tokens before it were) for one context key: decayed
    success/failure counts with a Beta prior of mean ``prior`` and weight ``prior_weight``."""

    prior: float = 0.5
    prior_weight: float = 2.0
    successes: float = 0.0
    failures: float = 0.0

    @property
    def probability(self) -> float:
        return (self.successes + self.prior * self.prior_weight) / (self.successes + self.failures + self.prior_weight)

    def update(self, successes: int, failures: int, decay: float) -> None:
        self.successes = self.successes * decay + successes
        self.failures = self.failures * decay + failures

    def shrink(self, factor: float) -> None:
        self.successes *= factor
        self.failures *= factor


@dataclass(frozen=True)
class CostModel:
    """Seconds of a cycle that drafts k tokens from drafter ``source``:

        cost(k) = verify(k + 1) + k · draft_fractions[source] · verify(1)

    ``verify(n)``: the measured forward cost of the target over n tokens (``costs.ForwardCosts``,
    measured once per model and machine and cached; without a table, the straight line 46 + 7n ms of
    docs/algorithms.md §Draft-length policies). ``draft_fractions``: a draft step of each drafter in
    units of a one-token target pass (``methods`` derives it from the weights a step reads against
    the target's: a decoding pass on a CPU costs about what it streams; n-gram lookup is free).
    Nothing here is learned from the clock: a stall of a shared machine would otherwise choose the
    next draft lengths, and a seed would no longer fix them.
    """

    forward_costs: object | None = None
    draft_fractions: dict[str, float] = field(default_factory=dict)

    def verify(self, tokens: int) -> float:
        if self.forward_costs is not None:
            return self.forward_costs.cost(tokens)
        return 0.046 + 0.007 * (tokens - 1)

    def draft_step(self, source: str) -> float:
        return self.draft_fractions.get(source, 0.0) * self.verify(1)

    def __call__(self, k: int, source: str = "") -> float:
        return self.verify(k + 1) + k * self.draft_step(source)


class CostAware(DraftPolicy):
    """Drafts the length that maximises expected emitted tokens per second (module docstring).

    Acceptance keys (``AcceptanceKey``): an n-gram lookup's tokens are keyed by the size of the
    matched n-gram and the previous block's streak (``MatchKey``); a drafter with a distribution's
    by the token's confidence bin and whether it is the block's first token (``ConfidenceKey``,
    whose prior is the bin's confidence itself); any other drafter's by its source and the streak
    (``SourceKey``). The first token the policy cut off is still scored when the verdict reveals
    its fate (``CycleOutcome.cut_key``). Estimates decay (a memory of about ten blocks), and a
    key the policy chose not to draft drifts back to its prior so that a context written off
    early is tried again. Every generation starts from the priors (``start``). ``trim`` only
    chooses; everything is learned in ``observe``.
    """

    def __init__(self, max_draft: int = 10, forward_costs=None, cost=None, decay: float = 0.9,
                 idle_decay: float = 0.99, draft_fractions: dict[str, float] | None = None):
        """``cost``: a function (k, source) → seconds instead of the ``CostModel`` of
        ``forward_costs`` and ``draft_fractions`` (tests)."""
        self.max_draft = _check_length("max_draft", max_draft)
        self.cost = CostModel(forward_costs, dict(draft_fractions or {})) if cost is None else cost
        self.decay, self.idle_decay = decay, idle_decay
        self.start()

    def start(self) -> None:
        self.acceptance: dict[AcceptanceKey, AcceptanceEstimate] = {}
        self.streak = False  # was the last verified block accepted whole?
        self.rates: dict[str, float] = {}  # per source: running expected tokens/s of its verified blocks

    def _estimate(self, key: AcceptanceKey) -> AcceptanceEstimate:
        estimate = self.acceptance.get(key)
        if estimate is None:
            estimate = self.acceptance[key] = AcceptanceEstimate(prior=key.prior)
        return estimate

    def keys(self, proposal, count: int) -> list[AcceptanceKey]:
        source = proposal.source
        if proposal.match_sizes is not None:
            return [MatchKey(source, size, self.streak) for size in proposal.match_sizes[:count]]
        if proposal.confidence is not None:
            return [self.confidence_key(source, float(c), i) for i, c in enumerate(proposal.confidence[:count])]
        return [SourceKey(source, self.streak)] * count

    @staticmethod
    def confidence_key(source: str, confidence: float, position: int) -> ConfidenceKey:
        """The key of a token drafted at ``confidence`` at block ``position``."""
        return ConfidenceKey(source, confidence_bin(confidence), position == 0)

    def _reach(self, keys: list[AcceptanceKey]) -> list[float]:
        reach, alive = [], 1.0
        for key in keys:
            alive *= self._estimate(key).probability
            reach.append(alive)
        return reach

    def _cost(self, source: str):
        return lambda k: self.cost(k, source)

    def unseen_later_acceptance(self, source: str, fallback: float) -> float:
        """P(accept) of a later-position token of ``source`` whose confidence is not known yet:
        the pooled evidence of all its later-position confidence keys (``fallback`` without any)."""
        successes = failures = 0.0
        for key, estimate in self.acceptance.items():
            if isinstance(key, ConfidenceKey) and key.source == source and not key.first:
                successes += estimate.successes
                failures += estimate.failures
        if successes + failures < 1.0:
            return fallback
        return successes / (successes + failures)

    def keep_drafting(self, confidences: list[float], source: str = "model") -> bool:
        """Stop once no longer draft can be expected to pay: further tokens, whose confidences
        are unknown until drafted, are scored at the source's pooled later-position acceptance
        (a later token is accepted far more often than the block's first: 0.75 vs 0.52 measured
        on the draft head). Drafting on costs only draft steps: :meth:`trim` still cuts the block."""
        drafted = len(confidences)
        if drafted >= self.max_draft:
            return False
        keys = [self.confidence_key(source, c, i) for i, c in enumerate(confidences)]
        reach = self._reach(keys)
        emitted = expected_emitted(reach)
        cost = self._cost(source)
        best_rate = max(emitted[k] / cost(k) for k in range(len(emitted)))
        step = self.unseen_later_acceptance(source, fallback=self._estimate(keys[-1]).probability)
        optimistic, p = emitted[-1], reach[-1]
        for k in range(drafted + 1, self.max_draft + 1):
            p *= step
            optimistic += p
            if optimistic / cost(k) > best_rate:
                return True
        return False

    def expected_rate(self, proposal) -> float:
        """The best expected emitted tokens per second over the lengths of ``proposal``."""
        count = min(len(proposal), self.max_draft)
        emitted = expected_emitted(self._reach(self.keys(proposal, count)))
        cost = self._cost(proposal.source)
        return max(emitted[k] / cost(k) for k in range(len(emitted)))

    def source_rate(self, source: str) -> float | None:
        """The running expected tokens per second of ``source``'s recent blocks (None: none yet)."""
        return self.rates.get(source)

    def trim(self, proposal) -> int:
        count = min(len(proposal), self.max_draft)
        if count == 0:
            return 0
        return best_length(self._reach(self.keys(proposal, count)), self._cost(proposal.source))

    def observe(self, outcome: CycleOutcome) -> None:
        if not outcome.drafted and outcome.cut_key is None:
            return  # nothing was drafted: nothing to learn
        # The block's expected rate, from the estimates it was chosen with (before this verdict).
        rate = expected_emitted(self._reach(outcome.keys))[outcome.drafted] / self.cost(outcome.drafted, outcome.source)
        previous = self.rates.get(outcome.source)
        self.rates[outcome.source] = rate if previous is None else 0.8 * previous + 0.2 * rate
        if not outcome.drafted:  # drafted, but none was worth verifying: let the first key drift back
            self._estimate(outcome.cut_key).shrink(self.idle_decay)
        # Positions up to and including the first rejection were evaluated; later ones were not.
        # Each key's evidence decays once per block (a memory of about ten blocks).
        counts: dict[AcceptanceKey, list[int]] = defaultdict(lambda: [0, 0])
        for i, key in enumerate(outcome.keys[: outcome.accepted + 1]):
            counts[key][0 if i < outcome.accepted else 1] += 1
        if outcome.cut_key is not None and outcome.cut_accepted is not None:
            counts[outcome.cut_key][0 if outcome.cut_accepted else 1] += 1
        for key, (successes, failures) in counts.items():
            self._estimate(key).update(successes, failures, self.decay)
        if outcome.drafted:
            self.streak = outcome.accepted == outcome.drafted
