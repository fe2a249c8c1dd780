"""Tree drafters (docs/algorithms.md §Token trees): the draft head growing a tree by cumulative probability (the
dynamic tree of EAGLE-2), n-gram lookup offering every distinct continuation of its matches as a
trie, and the hybrid of both; and the policy that sizes a tree from the measured pass costs.

Every node carries the policy's estimate of P(node accepted | its parent was): a *key* (what the
drafter knew: the head's probability bin, the n-gram match size) whose acceptance the policy
learns from every verdict, starting from a prior. A node's *value* is the product of the
estimates along its path, P(the walk reaches and keeps it); the expected tokens a tree emits are
1 + Σ values. The policy keeps the N best nodes (a parent's value is never below its child's, so
they form a tree) for the N that maximises (1 + Σ values) / (pass cost of P + N tokens + drafting
cost), and the head expands one more depth only while that rate is expected to improve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from ..policies import CONFIDENCE_BINS, AcceptanceEstimate, CostModel, DraftPolicy
from ..sampling import SamplingConfig, logits_to_probs
from ..llama import ATTENTION_ROWS
from ..tree import ROOT, TokenTree
from .base import Drafter
from .eagle import EagleDrafter
from .ngram import NgramDrafter


@dataclass
class TreeProposal:
    """A drafted tree with, per node, the policy's acceptance key and its prior (see the module
    docstring), the drafter's model steps, and who drafted."""

    tree: TokenTree
    keys: list[Hashable] = field(default_factory=list)
    priors: list[float] = field(default_factory=list)
    drafter_calls: int = 0
    source: str = ""
    rate: float = 0.0  # the policy's expected emitted tokens per second for this tree (``best_size``)

    @staticmethod
    def empty(source: str = "") -> "TreeProposal":
        return TreeProposal(TokenTree.empty(), source=source)


class TreePolicy(DraftPolicy):
    """Sizes trees: acceptance per node key learned from the verdicts of this generation (decayed
    counts with the drafter's prior), costs from the target's measured pass-cost table and a draft
    step's share of a pass (``CostModel``). Nothing read from the clock (a seed fixes the trees)."""

    def __init__(self, max_nodes: int = 15, max_depth: int = 8, forward_costs=None, draft_fractions=None,
                 decay: float = 0.98, prior_weight: float = 4.0, path_call_seconds: float = 0.0):
        """``path_call_seconds``: what one more attention call costs a pass (every layer), measured by
        ``costs.tree_call_seconds``: a tree pass attends once per root-to-leaf path (``llama.
        tree_attention_plan``), so a bushy tree costs more than a chain of as many tokens."""
        self.max_draft = max_depth
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.cost = CostModel(forward_costs, dict(draft_fractions or {}))
        self.path_call_seconds = path_call_seconds
        self.decay = decay
        self.prior_weight = prior_weight
        self.start()

    def start(self) -> None:
        self.estimates: dict[Hashable, AcceptanceEstimate] = {}

    def acceptance(self, key: Hashable, prior: float) -> float:
        estimate = self.estimates.get(key)
        return prior if estimate is None else estimate.probability

    def verify_tree(self, rows: int, leaves: int) -> float:
        """Seconds of a tree pass over ``rows`` tokens (pending + nodes) with ``leaves`` root-to-leaf
        paths: the chain pass of as many rows (whose attention runs in ceil(rows / ATTENTION_ROWS)
        calls) plus one call for each path beyond that (each path is at least one call)."""
        extra_calls = max(0, leaves - -(-rows // ATTENTION_ROWS))
        return self.cost.verify(rows) + extra_calls * self.path_call_seconds

    def best_size(self, values: list[float], parents: list[int], draft_seconds: float,
                  pending: int = 1) -> tuple[int, float]:
        """(N, expected emitted tokens per second) for the tree of the N best nodes (``values`` and
        ``parents`` in node order, ranked as ``_select`` ranks them): (1 + Σ values) / (draft_seconds +
        ``verify_tree``(pending + N, its leaves))."""
        best_n, best_rate, emitted = 0, 1.0 / (draft_seconds + self.cost.verify(pending)), 1.0
        has_child: set[int] = set()
        leaves = 0
        for n, node in enumerate(_ranked(values, parents)[: self.max_nodes], start=1):
            emitted += values[node]
            parent = parents[node]
            leaves += 0 if parent != ROOT and parent not in has_child else 1
            has_child.add(parent)
            rate = emitted / (draft_seconds + self.verify_tree(pending + n, leaves))
            if rate > best_rate:
                best_n, best_rate = n, rate
        return best_n, best_rate

    def observe_tree(self, proposal: TreeProposal, verdict) -> None:
        """Every node whose parent the walk reached was tried: kept iff it is on the path."""
        tree = proposal.tree
        reached = {ROOT, *verdict.path}
        kept = set(verdict.path)
        for estimate in self.estimates.values():
            estimate.update(0, 0, self.decay)
        for node, (key, prior) in enumerate(zip(proposal.keys, proposal.priors)):
            if int(tree.parents[node]) in reached:
                estimate = self.estimates.setdefault(key, AcceptanceEstimate(prior, self.prior_weight))
                estimate.update(int(node in kept), int(node not in kept), 1.0)


def _depths(parents: list[int]) -> list[int]:
    depth: list[int] = []
    for parent in parents:
        depth.append(1 if parent == ROOT else depth[parent] + 1)
    return depth


def _ranked(values: list[float], parents: list[int]) -> list[int]:
    """Nodes by value, largest first (ties: shallower, then earlier): a parent's value is never
    below its child's, so every prefix of the ranking is a tree."""
    depth = _depths(parents)
    return sorted(range(len(values)), key=lambda i: (-values[i], depth[i], i))


def _select(tokens: list[int], parents: list[int], values: list[float], keys: list, priors: list[float],
            count: int, drafter_calls: int, source: str, rate: float = 0.0) -> TreeProposal:
    """The ``count`` nodes of highest value (ties: shallower first), re-indexed parents first."""
    depth = _depths(parents)
    order = _ranked(values, parents)[:count]
    chosen = set(order)
    order = [i for i in sorted(order, key=lambda i: (depth[i], i)) if parents[i] == ROOT or parents[i] in chosen]
    index = {old: new for new, old in enumerate(order)}
    tree = TokenTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                     torch.tensor([ROOT if parents[i] == ROOT else index[parents[i]] for i in order], dtype=torch.long))
    return TreeProposal(tree, [keys[i] for i in order], [priors[i] for i in order], drafter_calls, source, rate)


def probability_bin(probability: float) -> int:
    return next(i for i, edge in enumerate(CONFIDENCE_BINS[1:]) if probability < edge)


class EagleTreeDrafter(EagleDrafter):
    """The draft head grows a tree: at each depth the ``branching`` likeliest tokens after each
    expanded node become candidates (value = the product of the estimated acceptances along the
    path, a node's estimate learned per bin of its head probability, the probability itself as
    the prior); the ``beam`` best candidates of the new depth are expanded in one head pass (tree
    attention in the head's own cache), while the policy expects the rate to rise; finally the
    policy keeps the best N candidates. In sampling mode candidates are ranked by the head's
    probability perturbed with the position's token noise (the target's own draw under the
    coupled rule is argmax(log q + g)), so the tree follows the sampled text."""

    proposes_trees = True

    def __init__(self, head, policy: TreePolicy, branching: int = 4, beam: int = 4):
        super().__init__(head)
        self.policy = policy
        self.branching = branching
        self.beam = beam

    def propose_tree(self, context: torch.Tensor, max_depth: int, sampling: SamplingConfig, noise) -> TreeProposal:
        policy = self.policy
        max_depth = min(max_depth, policy.max_depth)
        if max_depth <= 0:
            return TreeProposal.empty("head")
        h = self._catch_up(context)
        if h is None:
            return TreeProposal.empty("head")
        runner, ids = self.runner, self.head.draft_ids.cpu()
        committed = runner.length  # the head's cache: committed positions 0 .. committed − 1
        step = policy.cost.draft_step("head")
        tokens, parents, values, keys, priors = [], [], [], [], []
        slot_of: dict[int, int] = {}  # node → its slot in the head's cache
        frontier, frontier_h = [ROOT], h  # expanded nodes of the last depth and their outputs [f, H]
        node_h: dict[int, torch.Tensor] = {}  # an expanded node's head output [1, H]
        calls = 1
        try:
            for depth in range(1, max_depth + 1):
                logits = runner.logits(frontier_h).float()  # [f, K]
                probs = logits.softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)
                score = probs.log()
                if not sampling.greedy:
                    score = score + noise.gumbel(depth - 1)[ids]
                top = score.topk(min(self.branching, score.shape[-1]), dim=-1).indices  # [f, b]
                new = []
                for row, parent in enumerate(frontier):
                    parent_value = 1.0 if parent == ROOT else values[parent]
                    for choice in top[row].tolist():
                        probability = float(probs[row, choice])
                        if probability <= 0.0 or not math.isfinite(probability):
                            continue
                        key = ("head", probability_bin(probability), min(depth, 2))
                        new.append(len(tokens))
                        tokens.append(int(ids[choice]))
                        parents.append(parent)
                        keys.append(key)
                        priors.append(probability)
                        values.append(parent_value * policy.acceptance(key, probability))
                if depth == max_depth or not new:
                    break
                expand = sorted(new, key=lambda i: -values[i])[: self.beam]
                # Expand only while the best child of each expanded node is expected to pay for the step.
                _, rate_now = policy.best_size(values, parents, calls * step)
                typical = policy.acceptance(("head", probability_bin(0.5), 2), 0.5)
                _, rate_deeper = policy.best_size(values + [values[i] * typical for i in expand], parents + expand,
                                                  (calls + 1) * step)
                if rate_deeper <= rate_now:
                    break
                # one head pass over the expanded nodes: each sees the committed slots, its ancestors and itself
                base = runner.length
                n = len(expand)
                attends = torch.zeros(n, base + n, dtype=torch.bool)
                attends[:, :committed] = True
                for row, node in enumerate(expand):
                    ancestor = parents[node]
                    while ancestor != ROOT:
                        attends[row, slot_of[ancestor]] = True
                        ancestor = parents[ancestor]
                    attends[row, base + row] = True
                    slot_of[node] = base + row
                inputs = torch.cat([h if parents[node] == ROOT else node_h[parents[node]] for node in expand])
                positions = torch.full((n,), committed + depth - 1, dtype=torch.long)
                out = runner.extend(inputs, torch.tensor([tokens[i] for i in expand]), positions=positions, attends=attends)
                node_h.update({node: out[row : row + 1] for row, node in enumerate(expand)})
                frontier, frontier_h = expand, out
                calls += 1
        finally:
            runner.rollback(committed)
        count, rate = policy.best_size(values, parents, calls * step)
        return _select(tokens, parents, values, keys, priors, count, calls, "head", rate)


class NgramTreeDrafter(Drafter):
    """Prompt lookup offering every distinct continuation: for each match size (longest first)
    every earlier occurrence of the context's suffix, most recent first, contributes its
    continuation; the continuations merge into a trie. A node's key is (match size, depth, how
    many occurrences continue through it), learned by the policy."""

    proposes_trees = True

    def __init__(self, policy: TreePolicy, ngram_size: int = 3, min_ngram_size: int = 1, max_matches: int = 8):
        self.policy = policy
        self.lookup = NgramDrafter(ngram_size, min_ngram_size)
        self.max_matches = max_matches

    def continuations(self, context: np.ndarray, depth: int) -> tuple[list[np.ndarray], int]:
        """Up to ``max_matches`` continuations [≤ depth] of the longest suffix that occurs earlier."""
        lookup, n_ctx = self.lookup, len(context)
        for n in range(min(lookup.ngram_size, n_ctx - 1), lookup.min_ngram_size - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(context[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == context[n_ctx - n :]).all(axis=1))[::-1][: self.max_matches]
            if hits.size:
                return [context[h + n : h + n + depth] for h in hits.tolist()], n
        return [], 0

    def propose_tree(self, context: torch.Tensor, max_depth: int, sampling: SamplingConfig, noise) -> TreeProposal:
        max_depth = min(max_depth, self.policy.max_depth)
        if max_depth <= 0:
            return TreeProposal.empty("ngram")
        found, size = self.continuations(context.numpy(), max_depth)
        tokens, parents, support = [], [], []
        index: dict[tuple[int, int], int] = {}
        for continuation in found:
            parent = ROOT
            for token in continuation.tolist():
                node = index.get((parent, token))
                if node is None:
                    node = index[(parent, token)] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                    support.append(0)
                support[node] += 1
                parent = node
        values, keys, priors, depths = [], [], [], []
        for node, parent in enumerate(parents):
            depths.append(1 if parent == ROOT else depths[parent] + 1)
            share = support[node] / (len(found) if parent == ROOT else support[parent])
            key = ("ngram", size, min(depths[-1], 3), round(share, 1))
            prior = 0.5 * share
            keys.append(key)
            priors.append(prior)
            values.append((1.0 if parent == ROOT else values[parent]) * self.policy.acceptance(key, prior))
        count, rate = self.policy.best_size(values, parents, 0.0)
        return _select(tokens, parents, values, keys, priors, count, 0, "ngram", rate)


class HybridTreeDrafter(Drafter):
    """Per cycle, the n-gram trie alone or the head's tree merged with it, whichever the policy
    expects to emit more tokens per second (``best_size``: learned acceptance, the measured pass
    costs, the head's drafting steps). The n-gram trie is free to draft, so its rate is known before
    the head runs; the head's is the rate of the last merged tree (None until the head has drafted:
    it is tried first). When the trie's rate is higher the head is not run at all (no drafting
    time); otherwise the union is proposed: the n-gram nodes first, then the head's, the policy
    keeping the best nodes of the union by value."""

    proposes_trees = True

    def __init__(self, ngram: NgramTreeDrafter, eagle: EagleTreeDrafter):
        self.ngram, self.eagle = ngram, eagle
        self.needs_target_features = True
        self.feature_layers = eagle.feature_layers
        self.policy = eagle.policy
        self.head_rate: float | None = None

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self.head_rate = None
        self.eagle.start(prompt_ids, features, target_view)

    def commit(self, committed_length: int) -> None:
        self.eagle.commit(committed_length)

    def draft_step_weights(self) -> dict[str, int]:
        return self.eagle.draft_step_weights()

    def propose_tree(self, context, max_depth, sampling, noise) -> TreeProposal:
        ngram = self.ngram.propose_tree(context, max_depth, sampling, noise)
        if len(ngram.tree) and self.head_rate is not None and ngram.rate > self.head_rate:
            return ngram
        head = self.eagle.propose_tree(context, max_depth, sampling, noise)
        self.head_rate = head.rate
        if not len(ngram.tree):
            return head
        if not len(head.tree):
            return ngram
        # union as a trie; a node present in both keeps the n-gram's key (listed first)
        tokens, parents, keys, priors = [], [], [], []
        index: dict[tuple[int, int], int] = {}
        for proposal in (ngram, head):
            local: dict[int, int] = {}
            tree = proposal.tree
            for node in range(len(tree)):
                parent = ROOT if int(tree.parents[node]) == ROOT else local[int(tree.parents[node])]
                token = int(tree.tokens[node])
                merged = index.get((parent, token))
                if merged is None:
                    merged = index[(parent, token)] = len(tokens)
                    tokens.append(token)
                    parents.append(parent)
                    keys.append(proposal.keys[node])
                    priors.append(proposal.priors[node])
                local[node] = merged
        values = []
        for node, parent in enumerate(parents):
            values.append((1.0 if parent == ROOT else values[parent]) * self.policy.acceptance(keys[node], priors[node]))
        count, rate = self.policy.best_size(values, parents, head.drafter_calls * self.policy.cost.draft_step("head"))
        self.head_rate = rate
        return _select(tokens, parents, values, keys, priors, count, head.drafter_calls, "hybrid", rate)
