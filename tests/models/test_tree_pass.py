"""Tree passes in tierspec's Llama forward (docs/algorithms.md §Token trees): a node's logits equal a
chain pass of its path, bitwise; the accepted path's KV made contiguous; the attention calls a tree
pass makes."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.cached_model import CachedModel
from tierspec.errors import TierspecError
from tierspec.models import load_model
from tierspec.tree import TokenTree, tree_pass

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
