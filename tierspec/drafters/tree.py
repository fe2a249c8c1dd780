"""Tree drafters (docs/algorithms.md §Token trees): the draft head growing a tree by cumulative
probability (the dynamic tree of EAGLE-2), n-gram lookup offering every distinct continuation of
its matches as a trie, and the hybrid of both. They grow and cut their trees by what the method's
``policies.TreePolicy`` estimates (read through ``proposal.TreeView``): each node carries a key,
whose acceptance the policy learns from every verdict, and a prior; a node's value is the product
of the estimates along its path, and the policy keeps the nodes that maximise expected tokens per
second (``TreePolicy.best_size``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..llama import ATTENTION_ROWS
from ..policies import confidence_bin, node_depths, ranked_nodes
from ..proposal import DraftRequest, Proposal, Shape, TreeView
from ..sampling import logits_to_probs
from ..tree import ROOT, TokenTree
from .base import Drafter
from .eagle import EagleDrafter
from .ngram import NgramDrafter, suffix_matches


@dataclass(frozen=True)
class HeadNodeKey:
    """The acceptance key of a node the draft head proposed: the bin of its head probability
    (``policies.CONFIDENCE_BINS``) and whether it hangs below the root (a head's first token and
    its later ones are accepted at different rates at the same probability, as
    ``policies.ConfidenceKey`` says for chains)."""

    probability_bin: int
    first: bool


@dataclass(frozen=True)
class NgramNodeKey:
    """The acceptance key of a node of the n-gram trie: the matched n-gram's size, the node's
    depth class (depths ≥ ``NGRAM_DEPTH_CLASSES`` share one) and the share of the parent's
    continuations that run through it (rounded to ``SHARE_DECIMALS``)."""

    match_size: int
    depth_class: int
    share: float


#: N-gram nodes at depth 3 and deeper share one key: past the first few copied tokens a
#: continuation holds or breaks about alike, and each key needs verdicts to learn from.
NGRAM_DEPTH_CLASSES = 3
#: Shares of continuations are learned in tenths: finer classes would each see too few verdicts.
SHARE_DECIMALS = 1
#: The prior acceptance of an n-gram node all its parent's continuations run through (scaled by
#: its share): ``policies.MatchKey``'s prior, an n-gram copy right about half the time.
NGRAM_PRIOR = 0.5
#: The head probability a child not scored yet is valued at when the head weighs expanding one
#: more depth: the middle of the range (its own probability is known only once the head runs).
UNSCORED_CHILD_PROBABILITY = 0.5
#: EAGLE-2's expansion: the ``BRANCHING`` likeliest tokens after each expanded node become
#: candidates, and the ``BEAM`` best candidates of a depth are expanded in one head pass. A beam
#: of ``llama.ATTENTION_ROWS`` keeps each head pass at one attention call; as many candidates per
#: node as nodes per beam lets one strong node fill the whole beam.
BEAM = ATTENTION_ROWS
BRANCHING = BEAM
#: Most earlier occurrences of a suffix the n-gram trie takes continuations from (most recent first).
MAX_MATCHES = 8


def select_nodes(tokens: list[int], parents: list[int], values: list[float], keys: list, priors: list[float],
                 count: int, drafter_calls: int, source: str, rate: float = 0.0) -> Proposal:
    """The ``count`` nodes of highest value (ties: shallower first) as a proposal, re-indexed
    parents first."""
    depth = node_depths(parents)
    order = ranked_nodes(values, parents)[:count]
    chosen = set(order)
    order = [i for i in sorted(order, key=lambda i: (depth[i], i)) if parents[i] == ROOT or parents[i] in chosen]
    index = {old: new for new, old in enumerate(order)}
    tree = TokenTree(torch.tensor([tokens[i] for i in order], dtype=torch.long),
                     torch.tensor([ROOT if parents[i] == ROOT else index[parents[i]] for i in order], dtype=torch.long))
    return Proposal(tree, keys=[keys[i] for i in order], priors=[priors[i] for i in order], drafter_calls=drafter_calls,
                    source=source, rate=rate)


def empty_tree(source: str) -> Proposal:
    return Proposal(TokenTree.empty(), keys=[], priors=[], source=source)


class EagleTreeDrafter(EagleDrafter):
    """The draft head grows a tree: at each depth the ``branching`` likeliest tokens after each
    expanded node become candidates (value = the product of the estimated acceptances along the
    path, a node's estimate learned per bin of its head probability, the probability itself as
    the prior); the ``beam`` best candidates of the new depth are expanded in one head pass (tree
    attention in the head's own cache), while the policy expects the rate to rise; finally the
    policy keeps the best N candidates. In sampling mode candidates are ranked by the head's
    probability perturbed with the position's token noise (the target's own draw under the
    coupled rule is argmax(log q + g)), so the tree follows the sampled text."""

    proposes = Shape.TREE
    drafts_in_head_steps = False  # a tree's head passes attend along its paths: each sequence drafts its own

    def __init__(self, head, branching: int = BRANCHING, beam: int = BEAM):
        super().__init__(head)
        self.branching = branching
        self.beam = beam

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        policy: TreeView = request.policy  # methods pairs tree drafters with a TreePolicy
        sampling, noise = request.sampling, request.noise
        max_depth = min(request.budget, policy.max_depth)
        if max_depth <= 0:
            return empty_tree("head")
        h = self._caught_up(context)
        if h is None:
            return empty_tree("head")
        runner, ids = self.runner, self._draft_ids
        committed = runner.length  # the head's cache: committed positions 0 .. committed − 1
        step = policy.draft_step("head")
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
                    score = score + noise.gumbel_at(depth - 1, ids)  # the K tokens' noise only
                top = score.topk(min(self.branching, score.shape[-1]), dim=-1).indices  # [f, b]
                new = []
                for row, parent in enumerate(frontier):
                    parent_value = 1.0 if parent == ROOT else values[parent]
                    for choice in top[row].tolist():
                        probability = float(probs[row, choice])
                        if probability <= 0.0 or not math.isfinite(probability):
                            continue
                        key = HeadNodeKey(confidence_bin(probability), depth == 1)
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
                rate_now = policy.best_size(values, parents, calls * step).rate
                typical = policy.acceptance(HeadNodeKey(confidence_bin(UNSCORED_CHILD_PROBABILITY), False),
                                            UNSCORED_CHILD_PROBABILITY)
                rate_deeper = policy.best_size(values + [values[i] * typical for i in expand], parents + expand,
                                               (calls + 1) * step).rate
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
        size = policy.best_size(values, parents, calls * step)
        return select_nodes(tokens, parents, values, keys, priors, size.nodes, calls, "head", size.rate)


class NgramTreeDrafter(Drafter):
    """Prompt lookup offering every distinct continuation: for each match size (longest first)
    every earlier occurrence of the context's suffix, most recent first, contributes its
    continuation; the continuations merge into a trie. A node's key is (match size, depth, how
    many occurrences continue through it), learned by the policy."""

    proposes = Shape.TREE

    def __init__(self, ngram_size: int = 3, min_ngram_size: int = 1, max_matches: int = MAX_MATCHES):
        self.lookup = NgramDrafter(ngram_size, min_ngram_size)
        self.max_matches = max_matches

    def continuations(self, context: np.ndarray, depth: int) -> tuple[list[np.ndarray], int]:
        """Up to ``max_matches`` continuations [≤ depth] of the longest suffix that occurs earlier."""
        lookup, n_ctx = self.lookup, len(context)
        for n in range(min(lookup.ngram_size, n_ctx - 1), lookup.min_ngram_size - 1, -1):
            hits = suffix_matches(context, n)[::-1][: self.max_matches]
            if hits.size:
                return [context[h + n : h + n + depth] for h in hits.tolist()], n
        return [], 0

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        policy: TreeView = request.policy  # methods pairs tree drafters with a TreePolicy
        max_depth = min(request.budget, policy.max_depth)
        if max_depth <= 0:
            return empty_tree("ngram")
        found, size = self.continuations(np.asarray(context), max_depth)
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
            key = NgramNodeKey(size, min(depths[-1], NGRAM_DEPTH_CLASSES), round(share, SHARE_DECIMALS))
            prior = NGRAM_PRIOR * share
            keys.append(key)
            priors.append(prior)
            values.append((1.0 if parent == ROOT else values[parent]) * policy.acceptance(key, prior))
        tree_size = policy.best_size(values, parents, 0.0)
        return select_nodes(tokens, parents, values, keys, priors, tree_size.nodes, 0, "ngram", tree_size.rate)


class HybridTreeDrafter(Drafter):
    """Per cycle, the n-gram trie alone or the head's tree merged with it, whichever the policy
    expects to emit more tokens per second (``best_size``: learned acceptance, the measured pass
    costs, the head's drafting steps). The n-gram trie is free to draft, so its rate is known before
    the head runs; the head's is the rate of the last merged tree (None until the head has drafted:
    it is tried first). When the trie's rate is higher the head is not run at all (no drafting
    time); otherwise the union is proposed: the n-gram nodes first, then the head's, the policy
    keeping the best nodes of the union by value."""

    proposes = Shape.TREE
    needs_target_features = True

    def __init__(self, ngram: NgramTreeDrafter, eagle: EagleTreeDrafter):
        self.ngram, self.eagle = ngram, eagle
        self.feature_layers = eagle.feature_layers
        self.head_rate: float | None = None

    @property
    def feature_history(self) -> int:
        return self.eagle.feature_history

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self.head_rate = None
        self.eagle.start(prompt_ids, features, target_view)

    def commit(self, committed_length: int) -> None:
        self.eagle.commit(committed_length)

    def draft_step_weights(self) -> dict[str, int]:
        return self.eagle.draft_step_weights()

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        policy: TreeView = request.policy  # methods pairs tree drafters with a TreePolicy
        ngram = self.ngram.propose(context, request)
        if len(ngram.tree) and self.head_rate is not None and ngram.rate > self.head_rate:
            return ngram
        head = self.eagle.propose(context, request)
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
            values.append((1.0 if parent == ROOT else values[parent]) * policy.acceptance(keys[node], priors[node]))
        size = policy.best_size(values, parents, head.drafter_calls * policy.draft_step("head"))
        self.head_rate = size.rate
        return select_nodes(tokens, parents, values, keys, priors, size.nodes, head.drafter_calls, "hybrid", size.rate)
