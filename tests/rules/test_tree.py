"""Exact verification of token trees (docs/algorithms.md §Token trees): the greedy, coupled and
multi-draft walks, a tree cycle's joint law, tree methods giving plain decoding's tokens through the
one loop, the chain rules refusing trees, and the statistics of tree methods."""

from __future__ import annotations

import itertools

import pytest
import torch
from distributions import pooled_chi_square_p_value
from transformers import LlamaConfig, LlamaForCausalLM

from tierspec.errors import TierspecError
from tierspec.models import load_model
from tierspec.proposal import Proposal, Scores, Walk
from tierspec.rules import ExactRule
from tierspec.sampling import Noise, SamplingConfig, logits_to_probs
from tierspec.tree import ROOT, TokenTree, TreeError
from tierspec.walks import child_trials, match_tree_walk, tree_walk

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
