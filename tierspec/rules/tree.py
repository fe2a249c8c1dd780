"""Exact verification of a token tree (docs/algorithms.md §Token trees): one target pass scores every node, then a walk
from the root keeps the longest path the target's own draws agree with.

Notation (docs/algorithms.md §Token trees): p_c is the target's distribution after node c (after temperature, top-k,
top-p), c = root for the last committed position; r is the distribution the current step draws
from, starting at p_c; a child's proposal q is the distribution its token was drawn from (one-hot
for a child chosen deterministically: a top-k rank, an n-gram match).

``greedy``: from the root move to the child whose token equals argmax p_c; stop when none does
and emit argmax p_c (the correction, or the bonus at a leaf).

``coupled`` (the repository's default sampling rule, ``rules.exact``): the target's token after
node c at depth d is y = argmax(log p_c + g), g the token noise of position n + d (siblings share
a position, so they share it); move to the child equal to y, else emit y. The emitted tokens are
the target's sampled tokens whatever the tree holds, so plain decoding's text for the seed.

``residual`` (multi-draft speculative sampling, SpecInfer-style): at node c try its children in
node order; child x with proposal q is accepted with probability min(1, r(x)/q(x)); on rejection
r ← norm(max(0, r − q)) and, for sampled children, the next child's proposal is q with x removed
(q(x) ← 0, renormalised: siblings are drawn without replacement). On acceptance move to the child
(r ← p_child); when every child is rejected, or at a leaf, draw the next token from r and stop.
Each step emits y with probability p_c(y) exactly (induction over the children: the accepted
mass is min(q, r) and the rest is the residual's), so the emitted sequence has the target's law.
Every coin and draw of this walk has noise of its own (keyed by position, purpose and sibling
rank), never the token noise a drafter may have built the tree with, so the walk is exact for any
tree, whatever noise shaped it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import TierspecError
from ..sampling import ACCEPT, RESIDUAL, BlockNoise, SamplingConfig, gumbel_argmax, logits_to_probs, one_hot, \
    residual_distribution
from ..tree import ROOT, TokenTree, TreeError
from .base import DRAFTER, TARGET
from .exact import check_sampling_rule


@dataclass
class TreeVerdict:
    """The outcome of verifying a tree.

    path:       the accepted nodes, depth 1 first (their tokens are kept)
    next_token: the token after them (a correction, or the bonus after a leaf)
    deciders:   the tier that decided each emitted token (len(path) + 1)
    """

    path: list[int]
    next_token: int
    deciders: list[str] = field(default_factory=list)

    @property
    def accepted(self) -> int:
        return len(self.path)


def _row(node: int) -> int:
    """The row of a tree pass's scores [1 + m, V] that gives the distribution after ``node``."""
    return node + 1


def match_tree_walk(tree: TokenTree, next_token) -> tuple[list[int], int]:
    """Walk down while a child's token equals the target's token after the current node:
    ``next_token(node)`` → that token (node = ROOT first). Greedy (argmax) and coupled (perturbed
    argmax) verification are this walk. Returns (accepted nodes, the token after them)."""
    path, node = [], ROOT
    while True:
        token = int(next_token(node))
        match = [child for child in tree.children(node) if int(tree.tokens[child]) == token]
        if not match:
            return path, token
        node = match[0]  # siblings are distinct: at most one matches
        path.append(node)


@dataclass(frozen=True)
class ChildTrial:
    """One child tried at a node: its acceptance probability given it is reached, and the
    distribution the step draws from if it is rejected (after the children before it)."""

    token: int
    accept: float
    residual_after: torch.Tensor  # [V]


def child_trials(target_probs: torch.Tensor, tokens: list[int], draft_rows: torch.Tensor | None = None) -> list[ChildTrial]:
    """The multi-draft step at one node (module docstring, ``residual``): target_probs p_c [V], the
    children's ``tokens`` in the order tried, and ``draft_rows`` [len(tokens), V], the distribution
    each child was drawn from *before* its earlier siblings were removed (the drafter's q for
    sampled siblings, one-hot for a child chosen deterministically; None: all one-hot). Child j's
    proposal is its row with the tokens of children 0..j−1 zeroed and renormalised. The step's
    output law is Σ_j (Π_{i<j} (1 − a_i)) a_j δ(x_j) + Π_j (1 − a_j) r_m, which equals p_c (tests
    compute it from these trials)."""
    r = target_probs.double()
    trials = []
    for j, token in enumerate(tokens):
        if draft_rows is None:
            proposal = one_hot(token, r.shape[-1]).double()
        else:  # drawn without replacement: the earlier siblings were out of the draw
            proposal = draft_rows[j].double().clone()
            proposal[tokens[:j]] = 0.0
            total = proposal.sum()
            proposal = proposal / total if total > 0 else proposal
        if proposal[token] <= 0:
            raise TreeError(f"child token {token} has draft probability 0 in the distribution it was drawn from")
        accept = float(min(1.0, float(r[token] / proposal[token])))
        r = residual_distribution(r, proposal)
        trials.append(ChildTrial(token, accept, r))
    return trials


def multi_draft_walk(tree: TokenTree, target_probs: torch.Tensor, noise: BlockNoise) -> tuple[list[int], int]:
    """The ``residual`` walk over target_probs [1 + m, V] (row 0: after the root, row 1 + i: after
    node i) → (accepted nodes, the token after them)."""
    path, node, depth = [], ROOT, 0
    while True:
        children = tree.children(node)
        rows = None if tree.draft_probs is None or not children else tree.draft_probs[children]
        trials = child_trials(target_probs[_row(node)], [int(tree.tokens[c]) for c in children], rows)
        position = noise.start + depth  # the token after ``node`` sits here
        accepted = None
        for rank, (child, trial) in enumerate(zip(children, trials)):
            # the first sibling's coin is the chain rule's coin of this position (a chain verifies alike)
            purpose = ACCEPT if rank == 0 else f"{ACCEPT}/{rank}"
            if trial.accept >= 1.0 or (trial.accept > 0.0 and noise.noise.uniform(position, purpose) < trial.accept):
                accepted = child
                break
        if accepted is None:
            r = trials[-1].residual_after if trials else target_probs[_row(node)]
            token = int(gumbel_argmax(r.float(), noise.noise.gumbel(position, RESIDUAL)))
            return path, token
        path.append(accepted)
        node, depth = accepted, depth + 1


class TreeVerificationError(TierspecError):
    """Verification of a tree that the rule cannot do (no noise for a sampled walk)."""


def tree_walk(tree: TokenTree, target_logits: torch.Tensor, sampling: SamplingConfig, noise: BlockNoise | None,
              sampling_rule: str = "coupled") -> tuple[list[int], int]:
    """Verify ``tree`` against target logits [1 + m, V] (rows as ``multi_draft_walk``) →
    (accepted nodes, the token after them)."""
    if target_logits.shape[0] != len(tree) + 1:
        raise TreeError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} rows of target logits, got {target_logits.shape[0]}")
    if sampling.greedy:
        return match_tree_walk(tree, lambda node: target_logits[_row(node)].argmax())
    if noise is None:
        raise TreeVerificationError("sampled verification needs the block's noise (sampling.BlockNoise); got None")
    if check_sampling_rule(sampling_rule) == "coupled":
        def perturbed_argmax(node: int) -> int:
            depth = 0 if node == ROOT else int(tree.depths[node])
            return int(gumbel_argmax(logits_to_probs(target_logits[_row(node)], sampling), noise.gumbel(depth)))

        return match_tree_walk(tree, perturbed_argmax)
    return multi_draft_walk(tree, logits_to_probs(target_logits, sampling), noise)


class TreeExactRule:
    """Lossless verification of a token tree against the full target (``tree_walk``); a chain
    is the tree of one path. ``verifiers.target_tree_logits(tree)`` runs the pass."""

    name = "exact-tree"
    lossless = True
    accepts_trees = True

    def __init__(self, sampling_rule: str = "coupled"):
        self.sampling_rule = check_sampling_rule(sampling_rule)

    def verify_tree(self, verifiers, tree: TokenTree, sampling: SamplingConfig, noise: BlockNoise | None) -> TreeVerdict:
        target_logits = verifiers.target_tree_logits(tree)  # [1 + m, V]
        path, token = tree_walk(tree, target_logits, sampling, noise, self.sampling_rule)
        return TreeVerdict(path, token, [DRAFTER] * len(path) + [TARGET])
