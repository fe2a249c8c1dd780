"""Token trees (docs/algorithms.md §Token trees): the structure — tries of continuations, who sees
whom, the rules a tree keeps, a chain as the tree of one path, a tree pass's layout."""

from __future__ import annotations

import pytest
import torch

from tierspec.tree import ROOT, TokenTree, TreeError, tree_pass

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


def test_a_chains_token_list_is_its_tokens_kept_from_a_list_or_made_once():
    """``TokenTree.token_list``: the drafter's list kept (a copy: the caller's list may change), a
    prefix's its prefix, a tensor's tokens listed once; each equal to ``tokens.tolist()``."""
    drafted = [7, 3, 9]
    chain = TokenTree.chain(drafted)
    drafted.append(1)
    assert chain.token_list == chain.tokens.tolist() == [7, 3, 9]
    assert chain.prefix(2).token_list == chain.prefix(2).tokens.tolist() == [7, 3]
    from_tensor = TokenTree.chain(torch.tensor([4, 5]))
    assert from_tensor.token_list == [4, 5] and from_tensor.token_list is from_tensor.token_list
    assert from_tensor.prefix(1).token_list == [4]
    tree = TokenTree.from_paths([[1, 2], [1, 3]])
    assert tree.token_list == tree.tokens.tolist() == [1, 2, 3] and TokenTree.empty().token_list == []
