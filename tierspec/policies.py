"""Draft-length policies: how many drafted tokens each cycle sends to verification.

A policy is passed into the decode loop beside the drafter (docs/algorithms.md §The decode loop);
the method owns it, drafters only read it (``proposal.PolicyView``). Per cycle the loop

1. gives the drafter ``policy.max_draft`` as its budget (capped by the tokens left) and the
   policy itself to ask (``keep_drafting`` after each token a drafting model drafts; a tree
   drafter reads the node acceptance and the best tree size, ``TreeView``),
2. cuts the proposal to ``policy.trim(proposal)`` nodes,
3. after verification reports the cycle (``observe(CycleOutcome)``: what was drafted, what was
   verified, the verdict), from which the policy learns per drafted node whether it was
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
* ``TreePolicy(max_nodes, max_depth, ...)``: sizes token trees the same way (the tree drafters
  grow them by its estimates, it keeps the best nodes), learning per node key.

The pass-cost table a policy costs passes with (``pass_costs``) is the one the loop pads each
verification pass with: the policy holds it, measured and cached once per model (``methods``).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Hashable

from .costs import CONTEXT_STEP, ForwardCosts
from .errors import TierspecError
from .llama import ATTENTION_ROWS
from .proposal import Proposal, TreeSize, Verdict
from .tree import ROOT


class DraftPolicyError(TierspecError):
    """Invalid policy settings."""


# Coarse on purpose: each bin × first/later is learned on its own, and a generation is short.
CONFIDENCE_BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.95, 1.01)

#: The prior acceptance of a token whose drafter gave no confidence (an n-gram copy, a drafter
#: without a distribution): even odds until the verdicts say otherwise.
EVEN_ODDS = 0.5
#: The weight of a key's prior, in verdicts: two verdicts outweigh it (a chain key is seen about
#: once a cycle, so the estimate follows the text within a few cycles).
CHAIN_PRIOR_WEIGHT = 2.0
#: A chain key's evidence is multiplied by this after every verdict: a memory of about ten blocks.
CHAIN_DECAY = 0.9
#: A key the policy chose not to draft drifts back to its prior by this factor per cycle, so a
#: context written off early is tried again.
IDLE_DECAY = 0.99
#: The largest tree (nodes per pass, depth) when the method does not size it from the pass-cost
#: table: one row fewer than four ``llama.ATTENTION_ROWS`` calls, and a depth no draft head
#: sustains at the default model's acceptance.
TREE_NODES, TREE_DEPTH = 4 * ATTENTION_ROWS - 1, 8
#: A tree tries many keys per cycle, so each key's evidence lasts longer (about fifty cycles) and
#: its prior weighs more verdicts than a chain key's.
TREE_DECAY, TREE_PRIOR_WEIGHT = 0.98, 4.0


def confidence_bin(confidence: float) -> int:
    """The bin of ``confidence`` in [0, 1]: the last edge of ``CONFIDENCE_BINS`` at or below it."""
    return bisect.bisect_right(CONFIDENCE_BINS, confidence, hi=len(CONFIDENCE_BINS) - 1) - 1


@dataclass(frozen=True)
class MatchKey:
    """The acceptance context of a token an n-gram lookup copied: the size of the n-gram it
    matched (``Proposal.match_sizes``) and whether the previous block was accepted whole (copying
    runs in streaks)."""

    source: str
    match_size: int
    streak: bool

    prior = EVEN_ODDS


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

    prior = EVEN_ODDS


AcceptanceKey = MatchKey | ConfidenceKey | SourceKey


@dataclass(slots=True)
class CycleOutcome:
    """What the loop tells a policy after each verdict: the drafter's whole proposal
    (``drafted``), the part of it the policy let through to verification (``verified``, its
    first nodes) and the rule's ``verdict`` on that part."""

    drafted: Proposal
    verified: Proposal
    verdict: Verdict


class DraftPolicy:
    """Base class: a fixed budget, no early stop, no trimming, nothing learned.

    ``max_draft``: the most drafts on a path (a chain's length, a tree's depth). ``max_rows``:
    the most draft rows one verification pass carries (a chain: ``max_draft``; a tree: its
    nodes), which with the padding bounds the positions a generation can reach."""

    max_draft: int = 0

    @property
    def max_rows(self) -> int:
        return self.max_draft

    @property
    def pass_costs(self) -> ForwardCosts | None:
        """The target's measured pass-cost table this policy costs passes with, which the loop
        pads verification passes to the cheapest size by (None: passes are not padded)."""
        return None

    def start(self) -> None:
        """A new generation begins: forget what earlier generations taught (a server's method
        serves many requests; a seed must give the same drafts whatever ran before)."""

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        """Asked by a drafting model (``source``) after each drafted token, with the top
        probability at temperature 1 of every token drafted so far: draft another one?"""
        return True

    def trim(self, proposal, forced_after: list[int] | None = None) -> int:
        """How many leading tokens of ``proposal`` to verify (a pure choice: a policy learns only
        in ``observe``). ``forced_after``: under a constraint, for a chain, entry j is how many
        forced tokens the constraint appends after the first j drafts (``decode._forced_runs``),
        for j up to the drafts it takes (the later ones it cuts); each such token is accepted with
        probability 1 once the drafts before it are, and costs a pass row but no draft step."""
        return len(proposal)

    def keys(self, proposal, count: int) -> list[AcceptanceKey | None]:
        """The acceptance context of each of the first ``count`` tokens (for ``observe``); None
        for a policy that learns nothing."""
        return [None] * count

    def share_passes(self, sequences: int) -> None:
        """The next cycles' passes are shared by ``sequences`` generations (continuous batching):
        a policy that costs passes costs them as that batch's (``CostModel.verify``); 1 = alone."""

    def at_context(self, positions: int) -> None:
        """The next cycle's rows attend to ``positions`` cached positions: a policy that costs
        passes costs them there (``CostModel.at_context``)."""

    def observe(self, outcome: CycleOutcome) -> None:
        """Learn from a verdict."""


#: A tie in expected tokens per second within this relative margin goes to the shorter draft
#: (floating-point noise must not buy a longer, costlier pass).
RATE_TIE = 1e-9


def _check_length(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DraftPolicyError(f"{name} must be an integer >= 0, got {value!r}")
    return value


class FixedLength(DraftPolicy):
    """Draft γ tokens every cycle (0 = plain decoding). ``pass_costs``: a measured pass-cost table
    to pad verification passes to the cheapest size by (None: unpadded passes)."""

    def __init__(self, num_draft: int, pass_costs: ForwardCosts | None = None):
        self.max_draft = _check_length("num_draft", num_draft)
        self._pass_costs = pass_costs

    @property
    def pass_costs(self) -> ForwardCosts | None:
        return self._pass_costs


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

    def trim(self, proposal, forced_after: list[int] | None = None) -> int:
        confidence = proposal.confidence
        if confidence is None or self.threshold <= 0:
            return len(proposal)
        return next((i for i, c in enumerate(confidence) if c < self.threshold), len(proposal))


# ---- the cost-aware policy -------------------------------------------------------------------


def expected_emitted(reach: list[float]) -> list[float]:
    """E(k) for k = 0..n: expected tokens emitted by a block of k drafts, where ``reach[i]`` is
    the probability that drafts 1..i+1 are all accepted. E(k) = 1 + Σ_{i<k} reach[i] (the 1 is
    the correction or bonus token)."""
    out = [1.0]
    for r in reach:
        out.append(out[-1] + r)
    return out


def best_length(reach: list[float], cost, forced: list[int] | None = None, rows=None) -> int:
    """argmax_k E(k) / cost(k) over k = 0 .. len(reach) (ties → shorter).

    ``forced[k]``: tokens a constraint forces after k drafts, accepted with probability 1 once
    those k drafts are (reach[k − 1]; certain after none), each costing a pass row but no draft
    step (``rows(k, n)``: what n more rows add to the pass of k drafts). Then the rate of k is
    (E(k) + reach[k − 1] · forced[k]) / (cost(k) + rows(k, forced[k]))."""
    emitted = expected_emitted(reach)

    def rate(k: int) -> float:
        if not forced or not forced[k]:
            return emitted[k] / cost(k)
        certain = (reach[k - 1] if k else 1.0) * forced[k]
        return (emitted[k] + certain) / (cost(k) + rows(k, forced[k]))

    return best_of([rate(k) for k in range(len(emitted))])


def best_of(rates: list[float]) -> int:
    """The length k whose ``rates[k]`` is best, a longer one taken only where it beats the shorter's
    by more than ``RATE_TIE`` (``best_length``)."""
    best_k, best_rate = 0, rates[0]
    for k in range(1, len(rates)):
        if rates[k] > best_rate * (1 + RATE_TIE):
            best_k, best_rate = k, rates[k]
    return best_k


@dataclass
class AcceptanceEstimate:
    """P(a drafted token is accepted | the tokens before it were) for one context key: decayed
    success/failure counts with a Beta prior of mean ``prior`` and weight ``prior_weight``."""

    prior: float = EVEN_ODDS
    prior_weight: float = CHAIN_PRIOR_WEIGHT
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


#: (seconds of a one-token pass, seconds per further token) of a pass when no table was measured:
#: the straight line docs/algorithms.md §Draft-length policies starts from (the default model's
#: early measurement). Only tests and table-less policies use it.
UNMEASURED_PASS = (0.046, 0.007)

#: Weight of a source's earlier blocks in its running expected rate (``CostAware.rates``): about
#: the last five blocks count.
RATE_MEMORY = 0.8
#: Weight of a source's earlier cycles in what its drafts saved (``CostAware.saved``): about the
#: last twenty cycles count — a cycle's accepted count is a noisy draw, what it saves on average
#: is what decides whether drafting pays.
SAVED_MEMORY = 0.95


@dataclass(frozen=True)
class CostModel:
    """Seconds of a cycle that drafts k tokens from drafter ``source``:

        cost(k) = verify(k + 1) + k · draft_fractions[source] · verify(1)

    ``verify(n)``: the measured forward cost of the target over n tokens (``costs.ForwardCosts``,
    measured once per model and machine and cached; without a table, the straight line
    ``UNMEASURED_PASS`` of docs/algorithms.md §Draft-length policies). ``draft_fractions``: a draft step of each drafter in
    units of a one-token target pass (``methods`` derives it from the weights a step reads against
    the target's: a decoding pass on a CPU costs about what it streams; n-gram lookup is free; the
    draft head's step is measured once per machine beside a target pass, ``costs.draft_step_cost``).
    Nothing here is learned from the clock: a stall of a shared machine would otherwise choose the
    next draft lengths, and a seed would no longer fix them.
    """

    forward_costs: ForwardCosts | None = None
    draft_fractions: dict[str, float] = field(default_factory=dict)
    #: sequences sharing every pass (continuous batching, ``batch``): see ``verify``
    sequences: int = 1
    #: cached positions the generation's rows attend to (``at_context``; None: the table's own)
    context: int | None = None
    # verify(n) by n and the cycle's cost by (k, source), filled as asked: a policy asks for the same
    # few sizes many times a cycle, and nothing they depend on changes
    _verify: dict[int, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _cycle: dict[tuple[int, str], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _ceiling: dict[tuple[str, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _step: dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _bar: dict[tuple[str, int], tuple[float, bool]] = field(default_factory=dict, init=False, repr=False, compare=False)
    #: the models derived from one another (``in_batch``, ``at_context``) by (sequences, context), one dict
    #: shared by them all: a batch's size moves back and forth as generations finish and join, and each
    #: model's caches above then fill once, not once per move
    variants: dict[tuple[int, int | None], "CostModel"] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.variants.setdefault((self.sequences, self.context), self)

    def _pass(self, tokens: int) -> float:
        """The measured cost of one pass over ``tokens`` rows."""
        if self.forward_costs is not None:
            return self.forward_costs.cost(tokens, self.context)
        first, per_token = UNMEASURED_PASS
        return first + per_token * (tokens - 1)

    def verify(self, tokens: int) -> float:
        """A generation's cost of verifying ``tokens`` rows (its pending token and its drafts).
        Alone, the pass itself. In a batch of B sequences (one row each at least), its share of
        the batch's base pass plus what its extra rows add to that pass:

            verify_B(n) = pass(B) / B + pass(B + n − 1) − pass(B)

        (verify_1 = pass), so that each generation's draft length maximises its own tokens per
        second of the batch's time: a draft that pays alone may not pay in a batch, where a row
        is cheap but a draft step (``draft_step``, the drafter's own time) is not shared."""
        seconds = self._verify.get(tokens)
        if seconds is None:
            batch = self.sequences
            if batch == 1:
                seconds = self._pass(tokens)
            else:
                base = self._pass(batch)
                seconds = base / batch + self._pass(batch + tokens - 1) - base
            self._verify[tokens] = seconds
        return seconds

    def draft_step(self, source: str) -> float:
        """A draft step of ``source``: its fraction of a one-token pass alone (a drafter's steps
        run one sequence at a time, in a batch too) at the table's own context, where the fraction
        was measured: a drafter's own attention is a small part of its step, so its step does not
        grow with the context as the target's 30 layers' do."""
        seconds = self._step.get(source)
        if seconds is None:
            table = self.forward_costs
            seconds = self._step[source] = self.draft_fractions.get(source, 0.0) * (
                table.cost(1) if table is not None else self._pass(1))
        return seconds

    def in_batch(self, sequences: int) -> "CostModel":
        """This model for a generation that shares each pass with ``sequences`` − 1 others."""
        if sequences == self.sequences:
            return self
        return self._variant(sequences, self.context)

    def at_context(self, positions: int) -> "CostModel":
        """This model for a generation whose rows attend to ``positions`` cached positions, in steps
        of ``costs.CONTEXT_STEP`` (a row's attention grows with them: ``ForwardCosts.cost``)."""
        step = (positions // CONTEXT_STEP) * CONTEXT_STEP
        if step == self.context or self.forward_costs is None or not self.forward_costs.per_position:
            return self
        return self._variant(self.sequences, step)

    def _variant(self, sequences: int, context: int | None) -> "CostModel":
        """This model's family member for ``sequences`` and ``context`` (made once: ``variants``)."""
        model = self.variants.get((sequences, context))
        if model is None:  # made here; where two threads make one at once, both take the one kept
            CostModel(self.forward_costs, self.draft_fractions, sequences, context, self.variants)
            model = self.variants[(sequences, context)]
        return model

    def __call__(self, k: int, source: str = "") -> float:
        seconds = self._cycle.get((k, source))
        if seconds is None:
            seconds = self._cycle[(k, source)] = self.verify(k + 1) + k * self.draft_step(source)
        return seconds

    def ceiling(self, source: str, max_draft: int) -> float:
        """max over k = 1 .. ``max_draft`` of (1 + k) / cost(k): the tokens per second of ``source``'s
        best draft length were every draft accepted for certain (``CostAware.ceiling_rate``)."""
        rate = self._ceiling.get((source, max_draft))
        if rate is None:
            rate = self._ceiling[(source, max_draft)] = max(
                ((1.0 + k) / self(k, source) for k in range(1, max_draft + 1)), default=0.0)
        return rate

    def draft_bar(self, source: str, max_draft: int) -> tuple[float, bool]:
        """(the tokens per second a cycle of ``source``'s drafts must beat: drafting nothing, charged
        the drafter's one step a cycle costs before its drafts are chosen; whether not even
        ``max_draft`` drafts each certain to be accepted beat it — ``CostAware.draft_bar``)."""
        bar = self._bar.get((source, max_draft))
        if bar is None:
            worth = (1.0 + self.draft_step(source) / self.verify(1)) / self(0, "")
            bar = self._bar[(source, max_draft)] = (worth, self.ceiling(source, max_draft) <= worth)
        return bar


def _running_mean(means: dict[str, float], key: str, value: float, memory: float) -> None:
    """``means[key]`` moved toward ``value``, earlier values weighing ``memory`` (the first value taken as it is)."""
    previous = means.get(key)
    means[key] = value if previous is None else memory * previous + (1 - memory) * value


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
    chooses; everything is learned in ``observe``: the estimates (``acceptance``) and the streak
    change there and in ``start`` only, so a proposal is scored once between two verdicts
    (``_block``) — one who plants estimates by hand asks about a new proposal after.
    """

    def __init__(self, max_draft: int = 10, forward_costs: ForwardCosts | None = None, cost=None,
                 decay: float = CHAIN_DECAY, idle_decay: float = IDLE_DECAY,
                 draft_fractions: dict[str, float] | None = None):
        """``cost``: the ``CostModel`` to start from instead of one of ``forward_costs`` and
        ``draft_fractions`` — a method's generations share one, so that the costs it derives by
        batch size and context (``CostModel.variants``) are derived once, not once a generation —
        or a function (k, source) → seconds (tests)."""
        self.max_draft = _check_length("max_draft", max_draft)
        self.cost = CostModel(forward_costs, dict(draft_fractions or {})) if cost is None else cost
        self.decay, self.idle_decay = decay, idle_decay
        self.start()

    def start(self) -> None:
        self.acceptance: dict[AcceptanceKey, AcceptanceEstimate] = {}
        self.streak = False  # was the last verified block accepted whole?
        self.rates: dict[str, float] = {}  # per source: running expected tokens/s of its verified blocks
        self._keyed: tuple[Proposal, list[AcceptanceKey]] | None = None  # the last proposal keyed, its keys
        self._scored: tuple | None = None  # the last proposal scored: it, its cost model, reach and rates (``_block``)
        self._pooled: dict[str, tuple[float, float]] = {}  # per source: later-position evidence, until a verdict
        self.saved: dict[str, float] = {}  # per source: running seconds its cycles' drafts saved (``saved_seconds``)

    def _estimate(self, key: AcceptanceKey) -> AcceptanceEstimate:
        estimate = self.acceptance.get(key)
        if estimate is None:
            estimate = self.acceptance[key] = AcceptanceEstimate(prior=key.prior)
        return estimate

    def keys(self, proposal, count: int) -> list[AcceptanceKey]:
        # The same proposal is keyed by the hybrid's choice, the trim and the verdict, with the
        # streak unchanged in between: its keys are made once (forgotten when a verdict moves it).
        made = self._keyed
        if made is not None and made[0] is proposal and len(made[1]) >= count:
            return made[1][:count]
        source = proposal.source
        if proposal.match_sizes is not None:
            # one key a match size (a lookup's chain has one size, a constraint's forced tokens after it
            # size 0): a frozen dataclass takes 0.7 µs to make (warm, Zen 4), and one object compares by identity
            made_keys: dict[int, MatchKey] = {}
            keys = []
            for size in proposal.match_sizes[:count]:
                key = made_keys.get(size)
                if key is None:
                    key = made_keys[size] = MatchKey(source, size, self.streak)
                keys.append(key)
        elif proposal.confidence is not None:
            keys = [self.confidence_key(source, c, i) for i, c in enumerate(proposal.confidence[:count])]
        else:
            keys = [SourceKey(source, self.streak)] * count
        self._keyed = (proposal, keys)
        return keys

    @staticmethod
    def confidence_key(source: str, confidence: float, position: int) -> ConfidenceKey:
        """The key of a token drafted at ``confidence`` at block ``position``."""
        return ConfidenceKey(source, confidence_bin(confidence), position == 0)

    def _block(self, proposal, count: int) -> tuple[list[float], list[float]]:
        """(``reach``, the expected tokens per second of its first k drafts, k = 0 .. ``count``) of
        ``proposal``'s first ``count`` drafts. The hybrid's choice, the trim, a batch's cut and the
        verdict ask for the same proposal between two verdicts, with the estimates and the cost
        model unchanged: made once, and a shorter count is the longer one's prefix (reach[j] and
        rate k read drafts before them only)."""
        made, cost = self._scored, self.cost
        if made is None or made[0] is not proposal or made[1] is not cost or len(made[2]) < count:
            reach = self._reach(self.keys(proposal, count))
            emitted, source = expected_emitted(reach), proposal.source
            made = self._scored = (proposal, cost, reach, [emitted[k] / cost(k, source) for k in range(count + 1)])
        return made[2][:count], made[3][: count + 1]  # copies: a caller cannot change what is kept

    def _reach(self, keys: list[AcceptanceKey]) -> list[float]:
        reach, alive = [], 1.0
        last, probability = None, 1.0
        for key in keys:
            if key is not last:  # a run of one key (``keys``): its estimate read once
                last, probability = key, self._estimate(key).probability
            alive *= probability
            reach.append(alive)
        return reach

    def _cost(self, source: str):
        return lambda k: self.cost(k, source)

    def unseen_later_acceptance(self, source: str, fallback: float) -> float:
        """P(accept) of a later-position token of ``source`` whose confidence is not known yet:
        the pooled evidence of all its later-position confidence keys (``fallback`` without any)."""
        pooled = self._pooled.get(source)
        if pooled is None:  # the estimates change only with a verdict: pooled once per cycle
            successes = failures = 0.0
            for key, estimate in self.acceptance.items():
                if isinstance(key, ConfidenceKey) and key.source == source and not key.first:
                    successes += estimate.successes
                    failures += estimate.failures
            pooled = self._pooled[source] = (successes, failures)
        successes, failures = pooled
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

    def reach(self, proposal) -> list[float]:
        """P(drafts 0..j of ``proposal`` all accepted), j = 0 .. len − 1 (at most ``max_draft``), by
        the acceptance learned so far: what a batch weighs a proposal's drafts by (``batch``)."""
        count = min(len(proposal), self.max_draft)
        return self._block(proposal, count)[0] if count else []

    def expected_rate(self, proposal) -> float:
        """The best expected emitted tokens per second over the lengths of ``proposal``."""
        return max(self._block(proposal, min(len(proposal), self.max_draft))[1])

    def source_rate(self, source: str) -> float | None:
        """The running expected tokens per second of ``source``'s recent blocks (None: none yet)."""
        return self.rates.get(source)

    def saved_seconds(self, source: str) -> float | None:
        """What ``source``'s drafts saved a cycle of late, measured by the verdicts (None: no cycle
        yet): each cycle it proposed in, the passes its accepted drafts spared less what its
        verified drafts added to the pass and their draft steps — accepted · cost(0) − (cost(k) −
        cost(0)) by the cost model, 0 where it found nothing or nothing was worth verifying. Not the
        running *expected* rate (``source_rate``): that is the estimate each block was chosen by,
        which its own choice makes optimistic."""
        return self.saved.get(source)

    def plain_rate(self) -> float:
        """Tokens per second of a cycle that drafts nothing."""
        return 1.0 / self.cost(0, "")

    def ceiling_rate(self, source: str) -> float:
        """max over k = 1 .. ``max_draft`` of (1 + k) / cost(k): the rate of k drafts that are each
        accepted for certain. Where even it does not beat drafting nothing, no draft of ``source``
        can pay at the current costs (a batch shares its passes, so a row is cheap beside a draft
        step that is not shared: ``CostModel.verify``) and a drafter need not spend a step to learn so."""
        if isinstance(self.cost, CostModel):
            return self.cost.ceiling(source, self.max_draft)
        cost = self._cost(source)
        return max(((1.0 + k) / cost(k) for k in range(1, self.max_draft + 1)), default=0.0)

    def draft_bar(self, source: str) -> tuple[float, bool]:
        """(the rate a cycle in which ``source`` drafts must beat — ``plain_rate`` charged one draft
        step, ``draft_step_fraction`` of a pass — and whether even its ``ceiling_rate`` does not beat
        it). A function of the costs alone: made once per cost model (batch size, context), not
        every cycle of every sequence."""
        if isinstance(self.cost, CostModel):
            return self.cost.draft_bar(source, self.max_draft)
        worth = self.plain_rate() * (1.0 + self.draft_step_fraction(source))
        return worth, self.ceiling_rate(source) <= worth

    def draft_step_fraction(self, source: str) -> float:
        """A draft step of ``source`` in units of a one-token pass (0 for a cost function of a test's)."""
        if not isinstance(self.cost, CostModel):
            return 0.0
        return self.cost.draft_step(source) / self.cost.verify(1)

    def trim(self, proposal, forced_after: list[int] | None = None) -> int:
        """The length of best expected tokens per second; under a constraint (``forced_after``)
        never past the drafts it takes, and counting the forced run after each length as certain
        once its drafts are accepted (``best_length``)."""
        count = min(len(proposal), self.max_draft)
        if forced_after is not None:
            count = min(count, len(forced_after) - 1)
        if count == 0:
            return 0
        reach, rates = self._block(proposal, count)
        if not forced_after:
            return best_of(rates)  # ``best_length`` without forced tokens
        return best_length(reach, self._cost(proposal.source), forced_after[: count + 1], self._rows_cost(proposal.source))

    def _rows_cost(self, source: str):
        """(k, n) → seconds that n more rows add to the pass of a k-draft cycle: the measured pass
        costs' difference (a cost function of a test's has no rows of its own: n more drafts)."""
        if isinstance(self.cost, CostModel):
            return lambda k, n: self.cost.verify(k + n + 1) - self.cost.verify(k + 1)
        return lambda k, n: self.cost(k + n, source) - self.cost(k, source)

    def observe(self, outcome: CycleOutcome) -> None:
        verified, verdict = outcome.verified, outcome.verdict
        k, accepted = len(verified), verdict.accepted
        if outcome.drafted.source:  # what this cycle's drafts saved, by the verdict (``saved_seconds``)
            plain = self.cost(0, "")
            saved = accepted * plain - (self.cost(k, verified.source) - plain) if k else 0.0
            _running_mean(self.saved, outcome.drafted.source, saved, SAVED_MEMORY)
        if not len(outcome.drafted):
            return  # nothing was drafted: nothing to learn (an idle cycle of a batch, most of them)
        # The keys the trim saw (the streak has not moved since), one past the cut: after a fully
        # accepted block the target's bonus token tells whether the first token the policy cut
        # off would have been accepted (exact in greedy mode; in sampling mode "bonus == token" is
        # a conservative stand-in). Without it a policy that stops drafting a kind of token would
        # never learn that it should not have.
        keys = self.keys(outcome.drafted, min(len(outcome.drafted), k + 1))
        cut = len(keys) > k and accepted == k
        cut_key = keys[k] if cut else None
        keys = keys[:k]
        if not k and cut_key is None:
            return  # nothing was drafted: nothing to learn
        # The block's expected rate, from the estimates it was chosen with (before this verdict).
        rate = self._block(outcome.drafted, k)[1][k]  # (the verified drafts are the drafted ones' first k)
        _running_mean(self.rates, verified.source, rate, RATE_MEMORY)
        if not k:  # drafted, but none was worth verifying: let the first key drift back
            self._estimate(cut_key).shrink(self.idle_decay)
        # Positions up to and including the first rejection were evaluated; later ones were not.
        # Each key's evidence decays once per block (a memory of about ten blocks).
        counts: dict[AcceptanceKey, list[int]] = {}
        for i, key in enumerate(keys[: accepted + 1]):
            counts.setdefault(key, [0, 0])[0 if i < accepted else 1] += 1
        if cut:
            counts.setdefault(cut_key, [0, 0])[0 if verdict.next_token == outcome.drafted.token_list[k] else 1] += 1
        for key, (successes, failures) in counts.items():
            self._estimate(key).update(successes, failures, self.decay)
        if k:
            self.streak = accepted == k
        self._keyed = self._scored = None
        self._pooled.clear()

    @property
    def pass_costs(self) -> ForwardCosts | None:
        return self.cost.forward_costs if isinstance(self.cost, CostModel) else None

    def share_passes(self, sequences: int) -> None:
        if isinstance(self.cost, CostModel):  # a cost function of a test's stays as given
            self.cost = self.cost.in_batch(sequences)

    def at_context(self, positions: int) -> None:
        if isinstance(self.cost, CostModel):
            self.cost = self.cost.at_context(positions)


# ---- token trees ------------------------------------------------------------------------------


class TreePolicy(DraftPolicy):
    """Sizes token trees (docs/algorithms.md §Token trees): acceptance per node key learned from
    the verdicts of this generation (decayed counts with the drafter's prior), costs from the
    target's measured pass-cost table and a draft step's share of a pass (``CostModel``).
    Nothing read from the clock (a seed fixes the trees).

    Every node carries a key (what the drafter knew: the head's probability bin, the n-gram match
    size) and its prior. A node's *value* is the product of the estimates along its path,
    P(the walk reaches and keeps it); the expected tokens a tree emits are 1 + Σ values. The
    policy keeps the N best nodes (a parent's value is never below its child's, so they form a
    tree) for the N that maximises (1 + Σ values) / (pass cost of P + N tokens + drafting cost);
    the drafters grow trees with ``acceptance`` and stop growing them with ``best_size``."""

    def __init__(self, max_nodes: int = TREE_NODES, max_depth: int = TREE_DEPTH, forward_costs: ForwardCosts | None = None,
                 draft_fractions: dict[str, float] | None = None, decay: float = TREE_DECAY,
                 prior_weight: float = TREE_PRIOR_WEIGHT, path_call_seconds: float = 0.0,
                 cost: CostModel | None = None):
        """``max_nodes``, ``max_depth``: the largest tree (nodes per pass, depth); ``methods`` takes
        the nodes from the pass-cost table's size. ``decay``: the weight of a key's evidence after
        each verdict (a long memory: a tree tries many keys per cycle). ``prior_weight``: the
        prior's weight in verdicts. ``path_call_seconds``: what one more attention call costs a
        pass (every layer), measured by ``costs.tree_call_seconds``: a tree pass on the non-fused
        path attends once per root-to-leaf path (``llama.tree_attention_plan``), so a bushy tree
        costs more than a chain of as many tokens. ``cost``: the ``CostModel`` to start from instead
        of one of ``forward_costs`` and ``draft_fractions`` (a method's generations share one:
        ``CostAware``)."""
        self.max_draft = self.max_depth = _check_length("max_depth", max_depth)
        self.max_nodes = _check_length("max_nodes", max_nodes)
        self.cost = CostModel(forward_costs, dict(draft_fractions or {})) if cost is None else cost
        self.path_call_seconds = path_call_seconds
        self.decay = decay
        self.prior_weight = prior_weight
        self.start()

    def start(self) -> None:
        self.estimates: dict[Hashable, AcceptanceEstimate] = {}

    @property
    def max_rows(self) -> int:
        return self.max_nodes

    @property
    def pass_costs(self) -> ForwardCosts | None:
        return self.cost.forward_costs

    def share_passes(self, sequences: int) -> None:
        self.cost = self.cost.in_batch(sequences)

    def at_context(self, positions: int) -> None:
        self.cost = self.cost.at_context(positions)

    def acceptance(self, key: Hashable, prior: float) -> float:
        estimate = self.estimates.get(key)
        return prior if estimate is None else estimate.probability

    def draft_step(self, source: str) -> float:
        return self.cost.draft_step(source)

    def verify_tree(self, rows: int, leaves: int) -> float:
        """Seconds of a tree pass over ``rows`` tokens (pending + nodes) with ``leaves`` root-to-leaf
        paths: the chain pass of as many rows (whose attention runs in ceil(rows / ATTENTION_ROWS)
        calls) plus one call for each path beyond that (each path is at least one call)."""
        extra_calls = max(0, leaves - -(-rows // ATTENTION_ROWS))
        return self.cost.verify(rows) + extra_calls * self.path_call_seconds

    def best_size(self, values: list[float], parents: list[int], draft_seconds: float, pending: int = 1) -> TreeSize:
        """The tree of the N best nodes (``values`` and ``parents`` in node order, ranked as
        ``ranked_nodes`` ranks them) that maximises (1 + Σ values) / (draft_seconds +
        ``verify_tree``(pending + N, its leaves))."""
        best_n, best_rate, emitted = 0, 1.0 / (draft_seconds + self.cost.verify(pending)), 1.0
        has_child: set[int] = set()
        leaves = 0
        for n, node in enumerate(ranked_nodes(values, parents)[: self.max_nodes], start=1):
            emitted += values[node]
            parent = parents[node]
            leaves += 0 if parent != ROOT and parent not in has_child else 1
            has_child.add(parent)
            rate = emitted / (draft_seconds + self.verify_tree(pending + n, leaves))
            if rate > best_rate:
                best_n, best_rate = n, rate
        return TreeSize(best_n, best_rate)

    def observe(self, outcome: CycleOutcome) -> None:
        """Every node whose parent the walk reached was tried: kept iff it is on the path."""
        proposal, path = outcome.verified, outcome.verdict.path
        if proposal.keys is None:
            return  # a drafter that keys no nodes (a chain drafter under a tree policy) teaches nothing
        tree = proposal.tree
        reached = {ROOT, *path}
        kept = set(path)
        for estimate in self.estimates.values():
            estimate.update(0, 0, self.decay)
        for node, (key, prior) in enumerate(zip(proposal.keys, proposal.priors)):
            if int(tree.parents[node]) in reached:
                estimate = self.estimates.setdefault(key, AcceptanceEstimate(prior, self.prior_weight))
                estimate.update(int(node in kept), int(node not in kept), 1.0)


def node_depths(parents: list[int]) -> list[int]:
    """The depth of each node (1 below the root) of a tree given by its ``parents`` in node order."""
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent == ROOT else depth[parent] + 1)
    return depth


def ranked_nodes(values: list[float], parents: list[int]) -> list[int]:
    """Nodes by value, largest first (ties: shallower, then earlier): a parent's value is never
    below its child's, so every prefix of the ranking is a tree."""
    depth = node_depths(parents)
    return sorted(range(len(values)), key=lambda i: (-values[i], depth[i], i))
