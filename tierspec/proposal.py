"""The records the drafters and the rules share, and what each side may read of the other's owners.

One cycle of the decode loop moves one record each way (docs/algorithms.md §The decode loop):

    Proposal   drafter → rule    a token tree below the last committed token and, per node, what
                                 the drafter knew (its distribution, confidence, match size, key)
    Scores     pass → rule       the verifier's rows for that proposal, by node
    Verdict    rule → loop       the accepted path, the token after it, who decided each token

A chain of k drafts is the tree of one path (node i's parent is node i − 1): every drafter, every
rule and the one verifier pass speak of nodes, and a chain is only the case whose nodes sit at
their own positions. Terms, as the rules use them: a node is *accepted* (kept) when the walk moves
into it; the *next token* is the one emitted after the accepted path — a correction where a node
was rejected, a bonus token where the path ended at a leaf.

A drafter reads the method's draft-length policy through ``PolicyView`` (and its ``RateView`` /
``TreeView`` extensions), never the policy itself: the method owns the policy, the loop tells it
every verdict, and a drafter only asks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Protocol

import torch

from .sampling import BlockNoise, SamplingConfig
from .tree import ROOT, TokenTree

# Which tier decided an emitted token (per-tier statistics, docs/metrics.md §Tiers).
DRAFTER = "drafter"  # a draft token kept
SLIM = "slim"  # a token regenerated (or bonus) from the slim verifier / lower-tier mixture
TARGET = "target"  # a token decided with the full target's distribution
JUDGE = "judge"  # a draft the acceptance test rejected and the judge head kept


class Shape(enum.Enum):
    """What a drafter proposes and a rule verifies: chains only, or any token tree."""

    CHAIN = "chain"
    TREE = "tree"


@dataclass(slots=True)
class Proposal:
    """A drafted token tree (``tree``: m nodes, a chain of m drafts for chain drafters) and, per
    node, what the drafter knew about it. Row i of every per-node field belongs to node i.

    probs:         [m, K] the distribution each node's token was drawn from (after the sampling
                   transforms; for siblings drawn without replacement: before the earlier siblings
                   were removed), or None where it is the one-hot of the node's token: a drafter
                   without a distribution (n-gram lookup), and every drafter in greedy mode, whose
                   distribution is the one-hot of its argmax. ``vocabulary`` [K] names the target
                   ids of its columns (a draft head's reduced vocabulary); None: the target's ids.
    logits:        [m, K] raw logits where the drafter has them (deferral bits read them at
                   temperature 1), else None; columns as ``probs``. A drafter may give them as a
                   list of its steps' rows [K]: they are stacked the first time they are read
                   (``logits``) — the lossless rules and the policies never read them, and the
                   stack, a torch operator after the target's pass, is cold on a CPU whose caches
                   the pass empties.
    confidence:    per node, the top probability at temperature 1 of its distribution (floats), or None.
    match_sizes:   per node, the size of the n-gram whose continuation it copied (a policy's
                   acceptance key), or None.
    keys, priors:  per node, the acceptance key a tree policy learns and its prior (tree drafters).
    drafter_calls: forward passes of a drafting model spent on this proposal.
    source:        who drafted ("ngram", "model", "self", "head", …): a policy keeps costs and
                   acceptance apart per source.
    rate:          the policy's expected emitted tokens per second for this tree (tree drafters).
    forced:        how many of the last nodes (a chain's) a constraint forced (``constraints``): they
                   cost no draft step and are accepted with certainty; the drafter's own nodes are
                   the ``len − forced`` before them.
    """

    tree: TokenTree
    probs: torch.Tensor | None = None
    _logits: torch.Tensor | list[torch.Tensor] | None = None  # read as ``logits``
    vocabulary: torch.Tensor | None = None
    vocab_size: int = 0  # V: the width ``draft_probs`` / ``draft_logits`` widen narrow rows to
    confidence: list[float] | None = None
    match_sizes: list[int] | None = None
    keys: list[Hashable] | None = None
    priors: list[float] | None = None
    drafter_calls: int = 0
    source: str = ""
    rate: float = 0.0
    forced: int = 0
    _wide: dict | None = field(default=None, repr=False, compare=False)  # rows widened to V, made once

    @staticmethod
    def chain(tokens: torch.Tensor | list[int], probs: torch.Tensor | None = None,
              logits: torch.Tensor | list[torch.Tensor] | None = None, confidence: list[float] | None = None,
              match_sizes: list[int] | None = None, drafter_calls: int = 0,
              source: str = "", vocabulary: torch.Tensor | None = None, vocab_size: int = 0) -> "Proposal":
        """k drafts one after another (``tokens`` [k] int64, or a list of ints: kept as ``token_list``;
        ``logits`` [k, K] or the k rows [K] to stack when read)."""
        return Proposal(TokenTree.chain(tokens), probs, logits, vocabulary, vocab_size, confidence, match_sizes,
                        drafter_calls=drafter_calls, source=source)

    @staticmethod
    def empty(drafter_calls: int = 0, source: str = "") -> "Proposal":
        """Nothing drafted: the cycle is one plain decoding step."""
        return Proposal(_NO_DRAFTS, drafter_calls=drafter_calls, source=source)

    def __len__(self) -> int:
        return len(self.tree)

    @property
    def logits(self) -> torch.Tensor | None:
        """[m, K] raw draft logits, or None (class docstring; rows given as a list are stacked once)."""
        rows = self._logits
        if isinstance(rows, list):
            rows = self._logits = torch.stack(rows)
        return rows

    @property
    def tokens(self) -> torch.Tensor:
        """[m] int64, node i's token."""
        return self.tree.tokens

    @property
    def token_list(self) -> list[int]:
        """The same tokens as Python ints (``TokenTree.token_list``)."""
        return self.tree.token_list

    @property
    def is_chain(self) -> bool:
        return self.tree.is_chain

    def _widened(self, name: str, rows: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        if rows is None or self.vocabulary is None:
            return rows
        if self._wide is None:
            self._wide = {}
        if name not in self._wide:
            wide = torch.full((rows.shape[0], self.vocab_size), fill, dtype=rows.dtype)
            wide[:, self.vocabulary] = rows
            self._wide[name] = wide
        return self._wide[name]

    @property
    def draft_probs(self) -> torch.Tensor | None:
        """p [m, V] over the target's vocabulary (probability 0 outside a reduced vocabulary), or None."""
        return self._widened("probs", self.probs, 0.0)

    @property
    def draft_logits(self) -> torch.Tensor | None:
        """[m, V] raw logits over the target's vocabulary (−inf outside a reduced one), or None."""
        return self._widened("logits", self.logits, float("-inf"))

    def prefix(self, count: int) -> "Proposal":
        """The first ``count`` nodes with everything known about them (a policy's trim): a tree,
        since every node's parent comes before it."""
        if count >= len(self):
            return self

        def cut(x):
            return None if x is None else x[:count]

        rows = self._logits  # rows not stacked yet stay a list; none of them is a [0, K] tensor (a list cannot say K)
        logits = rows[0].new_empty((0, rows[0].shape[-1])) if count == 0 and isinstance(rows, list) else cut(rows)
        return Proposal(self.tree.prefix(count), cut(self.probs), logits, self.vocabulary, self.vocab_size,
                        cut(self.confidence), cut(self.match_sizes), cut(self.keys), cut(self.priors),
                        self.drafter_calls, self.source, self.rate, max(0, self.forced - (len(self) - count)))

    @property
    def without_forced(self) -> "Proposal":
        """The drafter's own nodes (without the constraint's forced ones after them)."""
        return self.prefix(len(self) - self.forced) if self.forced else self


_NO_DRAFTS = TokenTree.chain(torch.empty(0, dtype=torch.long))  # immutable: one for every empty proposal


@dataclass(slots=True)
class Verdict:
    """A rule's decision on one proposal.

    path:       the accepted nodes, depth 1 first (a chain: nodes 0 .. accepted − 1)
    next_token: the token emitted after them: a correction where a node was rejected, a bonus
                token where the path ends at a leaf
    deciders:   for each emitted token (len(path) + 1), the tier that decided it
    """

    path: list[int]
    next_token: int
    deciders: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        """Drafts kept (the accepted path's length)."""
        return len(self.path)

    @staticmethod
    def chain(accepted: int, next_token: int, deciders: list[str]) -> "Verdict":
        """The verdict on a chain that kept its first ``accepted`` drafts."""
        return Verdict(list(range(accepted)), next_token, deciders)


@dataclass(slots=True)
class Walk:
    """Where an acceptance walk ended: the accepted nodes (``path``, depth 1 first) and the token
    after them."""

    path: list[int]
    next_token: int

    @property
    def accepted(self) -> int:
        return len(self.path)

    @staticmethod
    def chain(accepted: int, next_token: int) -> "Walk":
        """A walk along a chain that kept its first ``accepted`` drafts."""
        return Walk(list(range(accepted)), next_token)


@dataclass(slots=True)
class Scores:
    """A verifier pass's rows for one proposal of m nodes (the full target's, or VIA's slim
    verifier's), with the sampling modifiers applied.

    logits: [1 + m, V] float32: row 0 after the last committed token (the root), row 1 + i after
            node i (a chain: row i scores draft i, row k gives the bonus token).
    hidden: [1 + m, H] the final hidden states of the same rows (the LM head's inputs; what a
            judge head reads), or None when the rule did not ask for them.
    first_maxima: each row of ``logits``' ``sampling.first_maxima`` where the pass found them in
            its LM head's product (the logits as the pass gave them: no modifier, no mask), else None.
    keyed_draws: each row's keyed draw where the pass made it in its LM head's product (``PassRequest.draws``:
            ``sampling.keyed_tokens`` of the row at the temperature under its key; ``sampling.NOT_DRAWN`` for a row
            left to the rule), else None.
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    first_maxima: list[int] | None = None
    keyed_draws: list[int] | None = None


# ---- what a drafter may read of the method's policy ---------------------------------------------


class PolicyView(Protocol):
    """What every drafter may ask the draft-length policy while it drafts (the method owns the
    policy; the loop tells it the verdicts)."""

    def keep_drafting(self, confidences: list[float], source: str = "") -> bool:
        """After each drafted token, with the top probability at temperature 1 of every token
        drafted so far: draft another one?"""
        ...


class RateView(PolicyView, Protocol):
    """A policy that can tell a drafter choosing between sources which one is expected to pay more
    (``policies.CostAware``: the hybrid drafter asks it)."""

    def expected_rate(self, proposal: Proposal) -> float:
        """Expected emitted tokens per second of the best trim of ``proposal``."""
        ...

    def source_rate(self, source: str) -> float | None:
        """The running expected tokens per second of ``source``'s recent blocks (None: none yet)."""
        ...

    def saved_seconds(self, source: str) -> float | None:
        """Seconds ``source``'s drafts saved a cycle of late, by the verdicts (None: none yet)."""
        ...

    def plain_rate(self) -> float:
        """Tokens per second of a cycle that drafts nothing (one token per one-token pass)."""
        ...

    def ceiling_rate(self, source: str) -> float:
        """The expected tokens per second of ``source``'s best draft length were every draft certain
        to be accepted: what no learned acceptance can beat."""
        ...

    def draft_step_fraction(self, source: str) -> float:
        """A draft step of ``source`` in units of a one-token pass."""
        ...

    def draft_bar(self, source: str) -> tuple[float, bool]:
        """(the rate a cycle of ``source``'s drafts must beat: ``plain_rate`` charged one draft step;
        whether not even ``ceiling_rate`` beats it)."""
        ...


@dataclass(frozen=True)
class TreeSize:
    """The best number of nodes to keep of a ranked tree, and the expected emitted tokens per
    second at that size."""

    nodes: int
    rate: float


class TreeView(PolicyView, Protocol):
    """What a tree drafter asks the tree policy (``policies.TreePolicy``) to grow and cut a tree."""

    max_depth: int

    def acceptance(self, key: Hashable, prior: float) -> float:
        """P(a node with ``key`` is accepted | its parent was), learned, starting from ``prior``."""
        ...

    def best_size(self, values: list[float], parents: list[int], draft_seconds: float, pending: int = 1) -> TreeSize:
        """The size of the tree of the best nodes (by ``values``) that maximises expected tokens/s."""
        ...

    def draft_step(self, source: str) -> float:
        """Seconds of one drafting step of ``source``."""
        ...


@dataclass(slots=True)
class DraftRequest:
    """What the loop asks of a drafter each cycle.

    budget:   the most drafts on any root-to-leaf path (a chain's length, a tree's depth): the
              policy's ``max_draft``, capped so the cycle cannot emit past the token budget
    sampling: the generation's sampling settings (drafts are drawn from the same transforms)
    noise:    the block's keyed noise (draft i is drawn with block position i's token noise);
              None in greedy mode
    policy:   the method's policy, to read (a tree drafter gets a ``TreeView``, the hybrid a
              ``RateView``: ``methods`` pairs them)
    """

    budget: int
    sampling: SamplingConfig
    noise: BlockNoise | None
    policy: PolicyView


def walk_reached(tree: TokenTree, path: list[int]) -> bool:
    """Whether a walk that accepted ``path`` tried a node below its end (it stopped at a rejection
    rather than at a leaf): that node counts as evaluated."""
    return bool(tree.children(path[-1] if path else ROOT))
