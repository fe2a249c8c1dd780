"""Tree drafters and the tree policy (docs/algorithms.md §Token trees): sizing a tree from the pass
costs, learning node acceptance from verdicts, the n-gram trie, the hybrid's choice."""

from __future__ import annotations

import pytest
import numpy as np
import torch

from tierspec.proposal import Proposal, TreeSize
from tierspec.tree import TokenTree

# ---- sizing a tree -------------------------------------------------------------------------------


def test_the_policy_keeps_the_node_count_that_maximises_expected_tokens_per_second():
    from tierspec.costs import ForwardCosts
    from tierspec.policies import TreePolicy

    # passes of 1-3 tokens cost the same, 4 tokens twice as much; a chain of three nodes
    chain = [-1, 0, 1]
    policy = TreePolicy(max_nodes=3, forward_costs=ForwardCosts({1: 1.0, 2: 1.0, 3: 1.0, 4: 2.0}))
    assert policy.best_size([0.9, 0.8, 0.5], chain, 0.0) == TreeSize(2, 2.7)  # 1 + 2 nodes fill the cheap pass: (1 + 1.7) / 1
    assert policy.best_size([0.9, 0.8, 0.5], chain, 0.0, pending=2).nodes == 1  # one pending token more: room for one node
    assert policy.best_size([0.05], [-1], 1.0).nodes == 1  # a free node is worth it when it adds anything
    expensive = TreePolicy(max_nodes=3, forward_costs=ForwardCosts({1: 1.0, 2: 3.0, 3: 3.0, 4: 3.0}))
    assert expensive.best_size([0.9, 0.6, 0.3], chain, 0.0) == TreeSize(0, 1.0)  # 3× the pass for ≤ 1.8 more tokens: no tree
    # nodes are taken in value order, not list order
    assert policy.best_size([0.9, 0.5, 0.8], [-1, 0, 0], 0.0) == TreeSize(2, 2.7)


def test_the_policy_charges_a_tree_one_attention_call_per_path_beyond_the_chains():
    from tierspec.costs import ForwardCosts
    from tierspec.policies import TreePolicy

    flat = ForwardCosts({n: 1.0 for n in range(1, 9)})
    free, costly = TreePolicy(max_nodes=7, forward_costs=flat), TreePolicy(max_nodes=7, forward_costs=flat,
                                                                          path_call_seconds=0.5)
    # one pending token and four siblings: 5 rows = 2 calls as a chain, 4 paths = 4 calls (2 more)
    siblings = ([0.6, 0.5, 0.4, 0.3], [-1, -1, -1, -1])
    assert free.best_size(*siblings, 0.0) == TreeSize(4, 2.8)
    assert costly.verify_tree(5, 4) == 2.0 and costly.verify_tree(5, 2) == 1.0 and costly.verify_tree(3, 3) == 2.0
    # each sibling beyond the first adds a call: 4 → 2.8 / 2.0, 2 → 2.1 / 1.5, 1 → 1.6 / 1 (best)
    assert costly.best_size(*siblings, 0.0) == TreeSize(1, 1.6)
    # the same values as a chain pay no such charge
    assert costly.best_size([0.6, 0.5, 0.4, 0.3], [-1, 0, 1, 2], 0.0) == TreeSize(4, 2.8)


def test_the_policy_learns_acceptance_of_every_node_whose_parent_was_reached():
    from tierspec.policies import CycleOutcome, TreePolicy
    from tierspec.proposal import Verdict

    tree = TokenTree.from_paths([[1, 2], [1, 3], [4]])  # nodes 0:1 1:2 2:3 3:4
    proposal = Proposal(tree, keys=["a", "b", "c", "d"], priors=[0.5, 0.5, 0.5, 0.5])
    policy = TreePolicy(prior_weight=1.0)
    policy.observe(CycleOutcome(proposal, proposal, Verdict([0], 9)))  # took node 0; then 2 and 3 were tried and failed
    assert policy.acceptance("a", 0.5) == pytest.approx(1.5 / 2)  # kept: (1 + 0.5·1) / (1 + 1)
    assert policy.acceptance("b", 0.5) == policy.acceptance("c", 0.5) == policy.acceptance("d", 0.5) == pytest.approx(0.25)
    policy.observe(CycleOutcome(proposal, proposal, Verdict([], 9)))  # rejected at the root: only 0 and 3 were tried
    assert policy.acceptance("b", 0.5) == pytest.approx(0.5 / (0.98 + 1))  # not tried: its one failure only decays
    assert policy.acceptance("e", 0.3) == 0.3  # never seen: the prior


def test_ngram_lookup_offers_every_distinct_continuation_as_a_trie():
    from conftest import draft_request

    from tierspec.drafters.tree import NgramTreeDrafter
    from tierspec.policies import TreePolicy

    context = np.array([5, 6, 1, 2, 5, 6, 1, 3, 9, 5, 6, 7, 5, 6])  # 5 6 was followed by 1 2, 1 3 and 7
    from tierspec.costs import ForwardCosts

    flat = ForwardCosts({n: 1.0 for n in range(1, 12)})  # every node free: all are kept
    drafter, policy = NgramTreeDrafter(ngram_size=2), TreePolicy(max_nodes=10, forward_costs=flat)
    found, size = drafter.continuations(context, 2)
    assert size == 2 and [c.tolist() for c in found] == [[7, 5], [1, 3], [1, 2]]  # most recent first
    proposal = drafter.propose(context, draft_request(2, policy=policy))
    assert sorted(proposal.tree.paths()) == [[1, 2], [1, 3], [7, 5]]
    assert proposal.source == "ngram" and len(proposal.keys) == len(proposal.tree) == 5


def test_the_hybrid_tree_skips_the_head_when_the_ngram_trie_is_expected_to_pay_more():
    from tierspec.costs import ForwardCosts
    from conftest import draft_request

    from tierspec.drafters.tree import HybridTreeDrafter, NgramTreeDrafter
    from tierspec.policies import TreePolicy

    # passes of 1-8 tokens cost the same; a head step costs a whole pass
    policy = TreePolicy(max_nodes=6, forward_costs=ForwardCosts({n: 1.0 for n in range(1, 9)}),
                        draft_fractions={"head": 1.0})

    class Head:  # a draft head's tree drafter that proposes one fixed tree of 3 steps
        feature_layers, calls = (), 0

        def propose(self, context, request):
            Head.calls += 1
            tree = TokenTree.from_paths([[40, 41], [42]])
            return Proposal(tree, keys=[("head", 3, 1)] * 3, priors=[0.5, 0.5, 0.5], drafter_calls=3, source="head",
                            rate=(1 + 0.5 + 0.25 + 0.5) / 4.0)

    hybrid = HybridTreeDrafter(NgramTreeDrafter(ngram_size=2), Head())
    request = draft_request(3, policy=policy)
    repetitive = np.array([5, 6, 1, 2, 3, 5, 6, 1, 2, 3, 5, 6])  # 5 6 → 1 2 3 (twice)
    first = hybrid.propose(repetitive, request)
    assert Head.calls == 1 and first.source == "hybrid"  # the head's rate is unknown: it drafts first
    assert sorted(first.tree.paths()) == [[1, 2, 3], [40, 41], [42]]
    # the union paid 3 head steps for its head nodes: (1 + Σ values) / (1 pass + 3 steps), below the
    # trie's (1 + 0.5 + 0.25 + 0.125) / 1 pass
    assert hybrid.head_rate == pytest.approx(first.rate) and first.rate < 1.875
    second = hybrid.propose(repetitive, request)
    assert Head.calls == 1 and second.source == "ngram" and second.drafter_calls == 0  # the head did not run
    assert second.tree.paths() == [[1, 2, 3]] and second.rate == pytest.approx(1.875)
    unmatched = np.array([5, 6, 1, 2, 3, 9])  # no earlier occurrence of a suffix: only the head drafts
    third = hybrid.propose(unmatched, request)
    assert Head.calls == 2 and third.source == "head"
