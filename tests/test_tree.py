"""Token trees (docs/algorithms.md §Token trees): the tree structure, tree passes in tierspec's Llama forward (a node's
logits equal a chain pass of its path, bitwise; the accepted path's KV made contiguous), and exact
verification over a tree (greedy, coupled, multi-draft)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_llama
from test_exact import pooled_chi_square_p_value
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.cached_model import CachedModel
from tierspec.errors import TierspecError
from tierspec.models import load_model
from tierspec.proposal import Proposal, Scores, TreeSize, Walk
from tierspec.rules import ExactRule
from tierspec.sampling import Noise, SamplingConfig, logits_to_probs
from tierspec.tree import ROOT, TokenTree, TreeError, tree_pass
from tierspec.walks import child_trials, match_tree_walk, tree_walk

# ---- the structure ----------------------------------------------------------------------------


def test_continuations_merge_into_a_trie():
    tree = TokenTree.from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3]])  # the last repeats the first
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert tree.parents.tolist() == [ROOT, 0, 1, 1, 0, ROOT]
    assert tree.depths.tolist() == [1, 2, 3, 3, 2, 1] and tree.depth == 3
    assert tree.children(ROOT) == [0, 5] and tree.children(1) == [2, 3] and tree.children(3) == []
    assert tree.path_to(3) == [0, 1, 3] and tree.path_to(ROOT) == []
    assert tree.paths() == [[1, 2, 3], [1, 2, 4], [1, 5], [6]]
    again = TokenTree.from_paths(tree.paths())
    assert torch.equal(again.tokens, tree.tokens) and torch.equal(again.parents, tree.parents)
    chain = TokenTree.chain([7, 7, 8])
    assert chain.parents.tolist() == [ROOT, 0, 1] and chain.paths() == [[7, 7, 8]]
    assert chain.is_chain and chain.depths.tolist() == [1, 2, 3] and chain.depth == 3 and chain.children(1) == [2]
    built = TokenTree(torch.tensor([7, 7, 8]), torch.tensor([ROOT, 0, 1]))  # a chain built node by node is one too
    assert built.is_chain and not tree.is_chain and not TokenTree.from_paths([[1], [2]]).is_chain
    assert chain.prefix(2).tokens.tolist() == [7, 7] and chain.prefix(2).is_chain
    assert tree.prefix(4).parents.tolist() == [ROOT, 0, 1, 1] and tree.prefix(9) is tree
    merged = tree.merged(TokenTree.from_paths([[1, 5, 9], [6, 2]]))
    assert merged.paths() == [[1, 2, 3], [1, 2, 4], [1, 5, 9], [6, 2]] and len(merged) == 8


def test_each_node_sees_its_ancestors_and_itself_only():
    tree = TokenTree.from_paths([[1, 2, 3], [1, 4], [5, 6]])  # nodes 0:1 1:2 2:3 3:4 4:5 5:6
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],  # node 3 (token 4) does not see its cousin branch 1 → 2
        [0, 0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.sees(), expected)


def test_trees_that_break_the_rules_are_refused():
    with pytest.raises(TreeError, match="node 1 has parent 1: a parent must be the root"):
        TokenTree(torch.tensor([4, 5]), torch.tensor([ROOT, 1]))
    with pytest.raises(TreeError, match="node 2 repeats token 5 among the children of 0"):
        TokenTree(torch.tensor([4, 5, 5]), torch.tensor([ROOT, 0, 0]))
    with pytest.raises(TreeError, match="one parent per token"):
        TokenTree(torch.tensor([4, 5]), torch.tensor([ROOT]))


def test_a_tree_pass_lays_out_pending_tokens_nodes_and_padding():
    tree = TokenTree.from_paths([[1, 2], [3]])  # nodes 0:1 (depth 1) 1:2 (depth 2) 2:3 (depth 1)
    layout = tree_pass(torch.tensor([8, 9]), tree, padding=1)
    assert layout.tokens.tolist() == [8, 9, 1, 2, 3, 3]
    assert layout.offsets.tolist() == [0, 1, 2, 3, 2, 2]  # the last pending token at 1, depth d at 1 + d
    assert layout.pending == 2 and layout.nodes == 3 and layout.padding == 1
    assert layout.attends.int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 0],  # padding repeats the last node (token, position, view)
    ]
    with pytest.raises(TreeError, match="needs the last committed token"):
        tree_pass(torch.empty(0, dtype=torch.long), tree)


# ---- tree passes in tierspec's Llama forward ----------------------------------------------------

# siblings, cousins with equal tokens, a node whose token equals its parent's, a deep branch
PLANTED = TokenTree.from_paths([[1, 2, 3, 4], [1, 2, 5], [1, 6, 7, 8, 9], [10, 11], [10, 12, 13], [14], [1, 2, 3, 15, 15, 16],
                                [6, 2, 3]])


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def exact_model(request, tmp_path_factory):
    """A random Llama on tierspec's code with the CPU kernels ``auto`` picks (as
    test_llama's bitwise test)."""
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=56, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    folder = tmp_path_factory.mktemp("tree-llama") / "m"
    LlamaForCausalLM(config).save_pretrained(folder)
    return load_model(folder, dtype=request.param, implementation="tierspec")


IDS = (torch.arange(600) * 31 + 7) % 56


SMALL = TokenTree.from_paths([[1, 2, 3], [1, 4], [5, 6], [5, 2, 7]])  # 8 nodes: a pass of ≤ 16 rows
WIDE = TokenTree.from_paths([[t] for t in range(1, 9)] + [[1, 9, 10], [4, 11]])  # 8 siblings: lanes 0-7 of a depth


@pytest.mark.parametrize("tree", [PLANTED, SMALL, WIDE], ids=["20-nodes", "8-nodes", "wide"])
@pytest.mark.parametrize("committed", [5, 498, 509, 512])  # the tree inside a 512-key block, and across one
@pytest.mark.parametrize("pending", [1, 3])
def test_a_tree_nodes_logits_equal_a_chain_pass_of_its_path(exact_model, tree, committed, pending):
    """Bitwise, in float32 and bfloat16, for every node and the root: each node's path is attended
    in the slots a chain pass of it fills (``llama.tree_attention_plan``; before, a path spread over
    the tree's slots was summed in other vector lanes and differed by ~3e-7 relative in float32)."""
    runner = CachedModel(exact_model.model)
    start = committed - pending  # the target has run the committed tokens before the pending ones
    with torch.inference_mode():
        runner.forward(IDS[:start], logits_for=1)
        layout = tree_pass(IDS[start:committed], tree, padding=2)
        scores = runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits
        assert runner.length == start + len(layout.tokens)
        for node in range(len(tree)):
            path = tree.path_to(node)
            runner.rollback(start)
            chain = runner.forward(torch.cat([IDS[start:committed], tree.tokens[path]])).logits[-1]
            assert torch.equal(scores[pending + node], chain), f"node {node}"
        runner.rollback(start)
        root = runner.forward(IDS[start:committed]).logits
        assert torch.equal(scores[:pending], root)  # the pending tokens' rows, the root's last
        assert torch.equal(scores[pending + len(tree) :], scores[pending + len(tree) - 1].expand(2, -1))  # padding


def test_a_tree_pass_attends_each_root_to_leaf_path_in_a_chains_slots():
    from tierspec.llama import ATTENTION_ROWS, tree_attention_plan

    tree = TokenTree.from_paths([[1, 2, 3], [1, 4], [5]])  # nodes 0:1 1:2 2:3 3:4 4:5
    layout = tree_pass(torch.tensor([8, 9]), tree, padding=2)  # rows: pending 0-1, nodes 2-6, padding 7-8
    plan = tree_attention_plan(layout.attends, layout.tokens, layout.offsets + 40, start=40, keys=512,
                               dtype=torch.float32, device=torch.device("cpu"))
    assert plan.copies is not None and plan.copies[0].tolist() == [7, 8] and plan.copies[1].tolist() == [6, 6]
    groups = {tuple(g.rows[: g.real].tolist()): g for g in plan.groups}
    # three root-to-leaf paths, three calls; a pending row fills the room in a shorter path's call
    assert sorted(groups) == [(0, 5), (1, 2, 3, 4), (6,)]
    first, second, third = groups[(1, 2, 3, 4)], groups[(0, 5)], groups[(6,)]
    assert first.moved is None  # path 1 → 2 → 3 is already in the chain's slots
    assert (second.first, second.moved.tolist()) == (3, [5])  # node 3 (token 4) into node 1's slot 43
    assert (third.first, third.moved.tolist()) == (2, [6])  # node 4 (token 5) at slot 42, a depth-1 slot
    assert plan.restore == 2
    for group in plan.groups:
        assert group.rows.shape[0] == ATTENTION_ROWS and group.mask.shape == (ATTENTION_ROWS, 512)
    # a row sees slots < 40 + the length of its view, as in a chain pass; call padding repeats the last row
    assert (first.mask == 0).sum(1).tolist() == [42, 43, 44, 45]
    assert (second.mask == 0).sum(1).tolist() == [41, 44, 44, 44] and second.rows.tolist() == [0, 5, 5, 5]
    assert (third.mask == 0).sum(1).tolist() == [43] * 4
    with pytest.raises(ValueError, match="may see new tokens j ≤ i only"):
        tree_attention_plan(torch.ones(2, 2, dtype=torch.bool), torch.tensor([1, 2]), torch.tensor([0, 1]), 0, 512,
                            torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("node", [3, 8, 12, 13])  # a leaf, a deep leaf, the deepest, a depth-1 leaf
def test_the_accepted_paths_kv_is_made_contiguous(exact_model, node):
    """After a tree pass, keeping the accepted path leaves the cache as a chain pass of that path
    would have: the next pass's logits are the same (bitwise in bfloat16; see above for float32)."""
    runner = CachedModel(exact_model.model)
    path = PLANTED.path_to(node)
    with torch.inference_mode():
        runner.forward(IDS[:500], logits_for=1)
        layout = tree_pass(IDS[500:501], PLANTED, padding=3)
        runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends)
        runner.compact(501, 501 + torch.tensor(path))
        assert runner.length == 501 + len(path) and set(runner.layer_lengths()) == {runner.length}
        after_tree = runner.forward(torch.tensor([20, 21])).logits
        runner.rollback(500)
        runner.forward(torch.cat([IDS[500:501], PLANTED.tokens[path]]))
        after_chain = runner.forward(torch.tensor([20, 21])).logits
        if exact_model.model.dtype == torch.bfloat16:
            assert torch.equal(after_tree, after_chain)
        torch.testing.assert_close(after_tree, after_chain, rtol=0, atol=1e-6 * float(after_chain.abs().max()))


def test_compaction_refuses_slots_outside_the_pass(exact_model):
    runner = CachedModel(exact_model.model)
    with torch.inference_mode():
        runner.forward(IDS[:10])
        with pytest.raises(ValueError, match="must increase within start"):
            runner.compact(5, torch.tensor([7, 6]))
        with pytest.raises(ValueError, match="must increase within start"):
            runner.compact(5, torch.tensor([4]))
        runner.compact(5, torch.tensor([6, 9]))
        assert runner.length == 7


def test_tree_passes_are_refused_on_transformers_modules():
    loaded = tiny_llama(seed=1)  # transformers' LlamaForCausalLM
    layout = tree_pass(torch.tensor([3]), PLANTED)
    with pytest.raises(TierspecError, match="token-tree passes run on tierspec's own Llama forward only"):
        CachedModel(loaded.model).forward(layout.tokens, offsets=layout.offsets, attends=layout.attends)


# ---- verification ------------------------------------------------------------------------------

V = 6
WALK_TREE = TokenTree.from_paths([[0, 1, 2], [0, 3], [1, 1], [4]])  # nodes 0:0 1:1 2:2 3:3 4:1 5:1 6:4
WALK = Proposal(WALK_TREE)  # deterministic children: no draft rows


def planted_probs(sampling: SamplingConfig, seed: int) -> torch.Tensor:
    """A target distribution [V] in float64 (renormalised there, so exact sums are exact)."""
    probs = logits_to_probs(planted_logits(WALK_TREE, seed)[0].double(), sampling).double()
    return probs / probs.sum()


def planted_logits(tree: TokenTree, seed: int = 0, sharpness: float = 2.0) -> torch.Tensor:
    """Target logits [1 + m, V] for a tree pass: a different distribution after every node."""
    generator = torch.Generator().manual_seed(seed)
    return sharpness * torch.randn(len(tree) + 1, V, generator=generator)


def test_greedy_walk_keeps_the_longest_path_that_agrees_with_the_argmax():
    logits = torch.full((len(WALK_TREE) + 1, V), -5.0)
    targets = {ROOT: 0, 0: 1, 1: 2, 2: 5, 3: 5, 4: 1, 5: 5, 6: 5}  # argmax after each node
    for node, token in targets.items():
        logits[node + 1, token] = 5.0
    walk = tree_walk(WALK, logits, SamplingConfig(), None)
    assert walk == Walk([0, 1, 2], 5)  # accepts 0 → 1 → 2, bonus at a leaf
    logits[1 + 0] = -5.0
    logits[1 + 0, 3] = 5.0  # after node 0 the target wants 3: the sibling branch
    assert tree_walk(WALK, logits, SamplingConfig(), None) == Walk([0, 3], 5)
    logits[0] = -5.0
    logits[0, 2] = 5.0  # no child of the root carries 2: rejects at once, correction 2
    assert tree_walk(WALK, logits, SamplingConfig(), None) == Walk([], 2)
    logits[1 + 0, 4] = 9.0
    assert match_tree_walk(WALK_TREE, lambda node: int(logits[node + 1].argmax())) == Walk([], 2)


SAMPLINGS = [SamplingConfig(1.0), SamplingConfig(0.6), SamplingConfig(1.3, top_k=3), SamplingConfig(0.8, top_p=0.7),
             SamplingConfig(1.0, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_the_coupled_walk_emits_the_targets_perturbed_argmax_whatever_the_tree(sampling):
    """The target's token at each depth is argmax(log p + g) of the node reached so far: the walk
    follows the child equal to it and emits it on a mismatch, so what is emitted is plain
    sampling's token sequence (written out here node by node)."""
    logits = planted_logits(WALK_TREE, seed=1)
    probs = logits_to_probs(logits, sampling)
    matched = 0
    for seed in range(300):
        noise = Noise(seed, V).block(10)
        walk = tree_walk(WALK, logits, sampling, noise, "coupled")
        path, token = walk.path, walk.next_token
        node, expected = ROOT, []
        while True:  # plain sampling along the tree, by hand
            y = int((probs[node + 1].log() + noise.gumbel(len(expected))).argmax())
            expected.append(y)
            child = [c for c in WALK_TREE.children(node) if int(WALK_TREE.tokens[c]) == y]
            if not child:
                break
            node = child[0]
        assert WALK_TREE.tokens[path].tolist() + [token] == expected
        matched += len(path)
    assert matched > 100  # the walk went down the tree, not only past its root


def one_step_law(target: torch.Tensor, tokens: list[int], draft: torch.Tensor | None) -> torch.Tensor:
    """The exact law of the token a multi-draft step emits at one node: Σ over the orders in which
    the children were drawn (``draft``: len(tokens) children drawn from it without replacement,
    every order enumerated with its probability; None: the deterministic ``tokens``) of
    Σ_j (Π_{i<j} (1 − a_i)) a_j δ(x_j) + Π_j (1 − a_j) r_m with the step's trials."""
    law = torch.zeros(V, dtype=torch.float64)
    orders = [(tuple(tokens), 1.0)]
    if draft is not None:
        orders = []
        for order in itertools.permutations(range(V), len(tokens)):
            weight, left = 1.0, draft.double().clone()
            for x in order:
                weight *= float(left[x] / left.sum())
                left[x] = 0.0
            if weight > 0:
                orders.append((order, weight))
    for order, weight in orders:
        reach = weight
        rows = None if draft is None else draft.expand(len(order), V)
        trials = child_trials(target, list(order), rows)
        for trial in trials:
            law[trial.token] += reach * trial.accept
            reach *= 1.0 - trial.accept
        law += reach * (trials[-1].residual_after if trials else target.double())
    return law


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("children", [[2], [0, 2], [3, 0, 5], [5, 4, 3, 2, 1, 0]])
def test_multi_draft_step_emits_the_target_distribution_for_deterministic_children(sampling, children):
    """Children chosen without sampling (a head's top-k, n-gram matches): one-hot proposals; tokens
    the target cannot draw (top-k / top-p zeros) among them, and all of V."""
    target = planted_probs(sampling, seed=2)
    assert torch.allclose(one_step_law(target, children, None), target, atol=1e-12, rtol=0)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_multi_draft_step_emits_the_target_distribution_for_sampled_children(sampling, count):
    """Children drawn from the drafter's q without replacement (every order enumerated); q with a
    zero where the target has mass and mass where the target has none."""
    target = planted_probs(sampling, seed=3)
    draft = torch.tensor([0.4, 0.3, 0.0, 0.15, 0.1, 0.05], dtype=torch.float64)
    assert torch.allclose(one_step_law(target, list(range(count)), draft), target, atol=1e-12, rtol=0)


def test_the_step_law_condemns_a_rule_without_the_residual_update():
    """The same sum finds a rule wrong that draws the last token from the target itself instead of
    the residual (planted: two one-hot children)."""
    target = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0], dtype=torch.float64)
    first, second = 0, 1
    trials = child_trials(target, [first, second], None)
    assert torch.allclose(one_step_law(target, [first, second], None), target, atol=1e-12, rtol=0)
    wrong = torch.zeros(V, dtype=torch.float64)
    wrong[first] += trials[0].accept
    wrong[second] += (1 - trials[0].accept) * trials[1].accept
    wrong += (1 - trials[0].accept) * (1 - trials[1].accept) * target
    assert torch.abs(wrong - target).sum() > 0.05


def planted_scores(model, tree: TokenTree) -> Scores:
    """A tree pass's scores from a planted model: the distribution after each node's path."""
    rows = [model(())] + [model(tuple(tree.tokens[tree.path_to(i)].tolist())) for i in range(len(tree))]
    return Scores(torch.stack(rows).log())


@pytest.mark.parametrize("sampling_rule", ["coupled", "residual"])
@pytest.mark.parametrize("sampled_children", [False, True])
def test_a_tree_cycle_emits_the_targets_joint_distribution(sampling_rule, sampled_children):
    """Two emitted tokens of a cycle over a depth-2 tree (continued by a plain draw when the cycle
    emits one), chi-square against the planted model's joint law q(y1) q(y2 | y1). With
    ``sampled_children`` the root's children are drawn from a drafter's q without replacement with
    the token noise the walk's own draws must not reuse."""
    table = {(): torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1, 0.0])}
    for y in range(V):
        table[(y,)] = torch.roll(torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05]), y)
    model = lambda prefix: table.get(prefix[:1], table[()]) if prefix else table[()]  # noqa: E731
    draft = torch.tensor([0.1, 0.1, 0.4, 0.3, 0.05, 0.05])
    rule = ExactRule(sampling_rule)
    sampling = SamplingConfig(1.0)
    counts = torch.zeros(V * V)
    accepted = 0
    for seed in range(6000):
        noise = Noise(seed, V).block(0)
        if sampled_children:
            left, first = draft.clone(), []
            for rank in range(2):  # Gumbel top-2 of q: a draw without replacement
                x = int((left.log() + noise.gumbel(0)).argmax()) if rank == 0 else \
                    int((left.log() + Noise(seed, V).gumbel(0, "draft/1")).argmax())
                first.append(x)
                left[x] = 0.0
            tree = TokenTree.from_paths([[first[0], 1], [first[1], 0, 2]])
            rows = torch.nn.functional.one_hot(tree.tokens, V).float()  # deeper nodes: chosen, not drawn
            rows[tree.children(ROOT)] = draft
            proposal = Proposal(tree, rows)
        else:
            tree = TokenTree.from_paths([[2, 1], [3, 0, 2], [0]])
            proposal = Proposal(tree)
        verdict = rule.decide(proposal, planted_scores(model, tree), sampling, noise)
        out = tree.tokens[verdict.path].tolist() + [verdict.next_token]
        accepted += verdict.accepted
        if len(out) == 1:
            out.append(int((model((out[0],)).log() + Noise(seed, V).gumbel(1, "next cycle")).argmax()))
        counts[out[0] * V + out[1]] += 1
    assert accepted > 1500
    joint = torch.stack([table[()][a] * table[(a,)] for a in range(V)]).flatten().double()
    assert pooled_chi_square_p_value(counts, joint) > 1e-3


def test_a_sampled_walk_needs_noise_and_rows_for_every_node():
    logits = planted_logits(WALK_TREE)
    with pytest.raises(TierspecError, match="needs the block's noise"):
        tree_walk(WALK, logits, SamplingConfig(1.0), None, "residual")
    with pytest.raises(TreeError, match="needs 8 rows of target logits, got 7"):
        tree_walk(WALK, logits[:7], SamplingConfig(), None)


# ---- the loop: tree methods give plain decoding's tokens ----------------------------------------


@pytest.fixture(scope="module")
def own_target(tmp_path_factory):
    """A peaked random Llama on tierspec's code (float64: no near-ties)."""
    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    folder = tmp_path_factory.mktemp("tree-loop") / "m"
    model.save_pretrained(folder)
    return load_model(folder, dtype="float64", implementation="tierspec")


def tree_methods(target):
    from conftest import as_method

    from tierspec.drafters.tree import EagleTreeDrafter, HybridTreeDrafter, NgramTreeDrafter
    from tierspec.heads.draft import DraftHead
    from tierspec.policies import TreePolicy

    def head():
        return DraftHead.for_target(target, torch.arange(target.vocab_size), seed=3).eval()

    def policy():
        return TreePolicy(max_nodes=12, max_depth=5, draft_fractions={"head": 0.05})

    return {
        "ngram-tree": as_method(NgramTreeDrafter(), ExactRule(), policy()),
        "eagle-tree": as_method(EagleTreeDrafter(head()), ExactRule(), policy()),
        "hybrid-tree": as_method(HybridTreeDrafter(NgramTreeDrafter(), EagleTreeDrafter(head())), ExactRule(), policy()),
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_methods_emit_plain_decodings_tokens_and_keep_the_cache_invariant(own_target, prompt_ids, temperature):
    from conftest import as_method, run_ids

    from tierspec.drafters import NoDrafter

    sampling = SamplingConfig(temperature)
    reference = run_ids(own_target, as_method(NoDrafter()), prompt_ids, 40, sampling, generator=7)

    def invariant(verifiers, drafter):
        assert verifiers.runner.length == verifiers.full_length == len(verifiers.context) - 1
        assert set(verifiers.runner.layer_lengths()) == {verifiers.runner.length}

    for name, method in tree_methods(own_target).items():
        steps = []
        out = run_ids(own_target, method, prompt_ids, 40, sampling, generator=7, inspect=invariant, on_step=steps.append)
        assert out == reference, name
        assert sum(step.cycle.accepted for step in steps) > 0, name  # trees were drafted and kept
        assert max(step.cycle.drafted for step in steps) > 1, name


@pytest.mark.parametrize("rule", ["lossy", "bild", "cascade", "judge", "via"])
def test_a_chain_rule_refuses_a_tree_drafter_and_names_the_alternatives(own_target, prompt_ids, rule):
    from conftest import as_method, run_ids

    from tierspec.drafters.tree import NgramTreeDrafter
    from tierspec.heads.judge import JudgeHead
    from tierspec.policies import TreePolicy
    from tierspec.proposal import Shape
    from tierspec.rules.bild import BildRule
    from tierspec.rules.judge import JudgeRule
    from tierspec.rules.lossy import LossyRule
    from tierspec.rules.speculative_cascades import SpeculativeCascadeRule
    from tierspec.rules.via import ViaRule

    head = JudgeHead(torch.zeros(32), 0.0, torch.zeros(32), torch.ones(32), "hidden", 0.5)
    chain_rule = {"lossy": LossyRule, "bild": BildRule, "cascade": SpeculativeCascadeRule,
                  "judge": lambda: JudgeRule(head), "via": lambda: ViaRule(0.1, 0.1, 8)}[rule]()
    assert chain_rule.accepts == {Shape.CHAIN} and ExactRule.accepts == {Shape.CHAIN, Shape.TREE}
    method = as_method(NgramTreeDrafter(), chain_rule, TreePolicy())
    with pytest.raises(TierspecError, match=rf"the rule '{chain_rule.name}' verifies chains only: a token tree needs the "
                                            r"exact rule .*eagle-tree and hybrid-tree, lossless\). For "
                                            rf"'{chain_rule.name}', use a chain drafter instead \(methods eagle, hybrid, pld\)"):
        run_ids(own_target, method, prompt_ids, 5)


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

    context = torch.tensor([5, 6, 1, 2, 5, 6, 1, 3, 9, 5, 6, 7, 5, 6])  # 5 6 was followed by 1 2, 1 3 and 7
    from tierspec.costs import ForwardCosts

    flat = ForwardCosts({n: 1.0 for n in range(1, 12)})  # every node free: all are kept
    drafter, policy = NgramTreeDrafter(ngram_size=2), TreePolicy(max_nodes=10, forward_costs=flat)
    found, size = drafter.continuations(context.numpy(), 2)
    assert size == 2 and [c.tolist() for c in found] == [[7, 5], [1, 3], [1, 2]]  # most recent first
    proposal = drafter.propose(context, draft_request(2, policy=policy))
    assert sorted(proposal.tree.paths()) == [[1, 2], [1, 3], [7, 5]]
    assert proposal.source == "ngram" and len(proposal.keys) == len(proposal.tree) == 5


# ---- statistics of tree methods ------------------------------------------------------------------


def test_tree_cycles_add_nodes_depth_accepted_length_and_acceptance_by_depth():
    from tierspec.decode import CycleStats, GenerationStats

    stats = GenerationStats()
    # (nodes, depth, accepted, evaluated): a walk stopped below its path, one that ran off a leaf,
    # one rejected at the root
    for nodes, depth, accepted, evaluated in ((10, 4, 2, 3), (6, 3, 3, 3), (8, 2, 0, 1)):
        stats.add(CycleStats(drafted=nodes, evaluated=evaluated, accepted=accepted, emitted=accepted + 1,
                             target_calls=1, slim_calls=0, drafter_calls=2, seconds=0.1, tree_depth=depth))
    tree = stats.to_dict()["tree"]
    assert tree == {"cycles": 3, "nodes_per_pass": 8.0, "max_nodes": 10, "depth_mean": 3.0, "max_depth": 4,
                    "accepted_per_cycle": round(5 / 3, 4), "accepted_length_counts": [1, 0, 1, 1],
                    # depth 1 reached 3×, kept 2×; depth 2 reached 2×, kept 2×; depth 3 reached 2×, kept 1×
                    "acceptance_by_depth": [round(2 / 3, 4), 1.0, 0.5]}
    chain = GenerationStats()
    chain.add(CycleStats(drafted=5, evaluated=3, accepted=2, emitted=3, target_calls=1, slim_calls=0, drafter_calls=0,
                         seconds=0.1))
    assert "tree" not in chain.to_dict() and chain.tree_summary() is None
    assert chain.to_dict()["accepted_per_cycle"] == 2.0 and chain.accepted_lengths == [0, 0, 1]


def test_a_tree_methods_stats_report_its_trees(own_target, prompt_ids):
    from tierspec.decode import GenerationStats

    method = tree_methods(own_target)["hybrid-tree"]
    from conftest import run_ids

    steps = []
    run_ids(own_target, method, prompt_ids, 30, on_step=steps.append)
    stats = GenerationStats()
    for step in steps:
        assert step.cycle.tree_depth is not None and step.cycle.tree_depth <= step.cycle.drafted
        stats.add(step.cycle)
    tree = stats.to_dict()["tree"]
    assert tree["cycles"] == len(steps) and tree["nodes_per_pass"] == round(sum(s.cycle.drafted for s in steps) / len(steps), 4)
    assert tree["max_depth"] == max(s.cycle.tree_depth for s in steps) and sum(tree["accepted_length_counts"]) == len(steps)
    assert tree["acceptance_by_depth"] == stats.to_dict()["acceptance_by_position"]


def test_bench_summary_reports_tree_shape_and_acceptance_by_depth():
    from dataclasses import asdict

    from tierspec.bench.report import markdown_table, summarize
    from tierspec.bench.runner import BenchConfig

    def record(prompt, method, **fields):
        return {"method": method, "prompt_id": prompt, "repeat": 0, "category": "qa", "tokens_per_s": 10.0,
                "peak_rss_mb": 1.0, "emitted": 12, "target_calls": 4, "evaluated": 8, "accepted": 8, "slim_calls": 0,
                "cycles": 4, "seconds": 1.0, "token_ids": [1], "text": "x", **fields}

    records = [record("p1", "ar", accepted=0, evaluated=0, cycles=12, target_calls=12),
               record("p1", "eagle-tree", position_drafted=[4, 3], position_accepted=[3, 1], tree_cycles=4,
                      tree_nodes=40, tree_depth=12, tree_max_nodes=14, accepted_lengths=[1, 2, 1],
                      draft_seconds=0.25, pass_seconds=0.5)]
    config = BenchConfig(target="t", methods=("ar", "eagle-tree"), dataset="spec_bench", max_new_tokens=12)
    overall = summarize(records, config, {})["methods"]["eagle-tree"]["overall"]
    assert overall["nodes_per_pass"] == 10.0 and overall["tree_depth_mean"] == 3.0 and overall["max_nodes"] == 14
    assert overall["acceptance_by_depth"] == [0.75, 1 / 3] and overall["accepted_per_cycle"] == 2.0
    ar = summarize(records, config, {})["methods"]["ar"]["overall"]
    assert "nodes_per_pass" not in ar
    table = markdown_table({"config": asdict(config), "methods": summarize(records, config, {})["methods"]})
    assert "| `eagle-tree` | 10.0 | 14 | 3.00 | 2.00 | 0.75, 0.33 |" in table
    # where the time goes: 1 s at 10 tokens/s, a quarter drafting, half in passes
    assert "| `eagle-tree` | 100.0 | 0.25 | 0.50 | 0.25 |" in table


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
    repetitive = torch.tensor([5, 6, 1, 2, 3, 5, 6, 1, 2, 3, 5, 6])  # 5 6 → 1 2 3 (twice)
    first = hybrid.propose(repetitive, request)
    assert Head.calls == 1 and first.source == "hybrid"  # the head's rate is unknown: it drafts first
    assert sorted(first.tree.paths()) == [[1, 2, 3], [40, 41], [42]]
    # the union paid 3 head steps for its head nodes: (1 + Σ values) / (1 pass + 3 steps), below the
    # trie's (1 + 0.5 + 0.25 + 0.125) / 1 pass
    assert hybrid.head_rate == pytest.approx(first.rate) and first.rate < 1.875
    second = hybrid.propose(repetitive, request)
    assert Head.calls == 1 and second.source == "ngram" and second.drafter_calls == 0  # the head did not run
    assert second.tree.paths() == [[1, 2, 3]] and second.rate == pytest.approx(1.875)
    unmatched = torch.tensor([5, 6, 1, 2, 3, 9])  # no earlier occurrence of a suffix: only the head drafts
    third = hybrid.propose(unmatched, request)
    assert Head.calls == 2 and third.source == "head"


def test_the_attention_calls_of_a_tree_pass_are_one_per_path_and_a_chains_one_per_four_rows():
    from tierspec.costs import _attention_calls
    from tierspec.tree import TokenTree, tree_pass

    chain = tree_pass(torch.tensor([5]), TokenTree(torch.arange(15), torch.arange(-1, 14)))
    assert _attention_calls(chain.attends, chain.tokens, chain.offsets, 256) == 4  # 16 rows
    # 8 children of the root, 7 with a child: 8 paths of ≤ 3 rows, one call each
    bushy = tree_pass(torch.tensor([5]), TokenTree(torch.arange(15), torch.tensor([-1] * 8 + list(range(7)))))
    assert _attention_calls(bushy.attends, bushy.tokens, bushy.offsets, 256) == 8
    # a chain of 7 under the root with one sibling leaf: 2 calls for the chain's 8 rows, 1 for the leaf
    forked = tree_pass(torch.tensor([5]), TokenTree(torch.arange(8), torch.tensor([-1, 0, 1, 2, 3, 4, 5, -1])))
    assert _attention_calls(forked.attends, forked.tokens, forked.offsets, 256) == 3
