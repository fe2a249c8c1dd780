"""Methods not covered elsewhere: SWIFT (mask optimised on the fly through the cached model),
VIA-SD + judge, and `tierspec route` end to end on a tiny model folder."""

import json

import pytest
import torch
from conftest import as_method, char_tokenizer, run_ids, tiny_llama

from tierspec.cached_model import CachedModel
from tierspec.drafters import NgramDrafter, NoDrafter
from tierspec.heads.judge import JudgeHead
from tierspec.methods import MethodOptions, build_method
from tierspec.models import ModelLoadError
from tierspec.layerskip.masks import RoutingMask
from tierspec.rules.via import ViaRule


def test_replay_reads_the_prefix_and_restores_the_cache_exactly(tiny_target):
    """SWIFT scores a candidate mask by re-running the last committed tokens under it on top of
    the cached full-model KV; afterwards the cache is bit-for-bit what it was."""
    tokens = torch.tensor([3, 17, 42, 8, 8, 19, 60, 1, 5, 33])
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    runner = CachedModel(tiny_target.model)
    runner.forward(tokens)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in runner.cache.layers]
    replayed = runner.replay(4, tokens[4:9], mask)
    # the same logits as a masked pass over the window after a 4-token full-model prefix
    fresh = CachedModel(tiny_target.model)
    fresh.forward(tokens[:4])
    assert torch.allclose(replayed, fresh.forward(tokens[4:9], mask=mask).logits, atol=1e-10)
    assert runner.length == 10
    for (keys, values), layer in zip(before, runner.cache.layers):
        assert torch.equal(keys, layer.keys) and torch.equal(values, layer.values)


def test_swift_greedy_equals_ar_and_keeps_the_cache_invariant(tiny_target, prompt_ids):
    reference = run_ids(tiny_target, as_method(NoDrafter()), prompt_ids, 40)
    method = build_method("swift", tiny_target, options=MethodOptions(num_draft=3, confidence_threshold=0.0))

    drafters = set()

    def inspect(verifiers, drafter):
        assert verifiers.runner.layer_lengths() == [len(verifiers.context) - 1] * 4
        drafters.add(drafter)

    assert run_ids(tiny_target, method, prompt_ids, 40, inspect=inspect) == reference
    (drafter,) = drafters  # the generation's own
    assert drafter.optimisation_calls > 0 and len(drafter.history) > 0


def test_via_judge_with_a_judge_that_never_accepts_and_full_verification_equals_ar(tiny_target, prompt_ids):
    reference = run_ids(tiny_target, as_method(NoDrafter()), prompt_ids, 40)
    head = JudgeHead(torch.zeros(32), -10.0, torch.zeros(32), torch.ones(32), "hidden", 0.5)
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    rule = ViaRule(0.0, 0.0, 20, force_full=True, judge=head)
    assert run_ids(tiny_target, as_method(NgramDrafter(3), rule, num_draft=4, slim_mask=mask), prompt_ids, 40) == reference


def test_via_judge_method_runs_and_a_judge_that_always_accepts_keeps_drafts(tiny_target, prompt_ids):
    head = JudgeHead(torch.zeros(32), 10.0, torch.zeros(32), torch.ones(32), "hidden", 0.5, tiny_target.identity)
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    method = build_method("via-judge", tiny_target, options=MethodOptions(mask=mask, judge_head=head, alpha2=0.0,
                                                                          drafter_kind="ngram", num_draft=4))
    steps = []
    run_ids(tiny_target, method, prompt_ids, 30, on_step=steps.append)
    judged = sum(step.cycle.deciders.count("judge") for step in steps)
    assert judged > 0  # where the full target decided, the judge kept rejected drafts


def test_route_command_writes_a_mask_for_a_model_folder(tmp_path, capsys):
    from tierspec.cli import main

    model = tiny_llama(seed=4, vocab_size=56, layers=4, sharpness=20.0).model
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("the cat sat on the mat and then the dog sat too\nwhat is two plus two? it is four.\n")
    out = tmp_path / "mask.json"
    code = main(["route", "--target", str(folder), "--ratio", "0.25", "--unit", "sublayer", "--budget", "4",
                 "--bo-every", "2", "--calibration-file", str(calibration), "--window", "6", "--context", "4",
                 "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["format"] == "tierspec-routing-mask" and data["evaluations"] == 4
    assert len(data["skip_attention"]) + len(data["skip_mlp"]) == 2  # round(0.25 · 8 units)
    from tierspec.models import load_model

    RoutingMask.load(out, load_model(folder).identity)  # made for this model: accepted
    with pytest.raises(Exception, match="layers"):
        RoutingMask.load(out, tiny_llama(seed=1, layers=6).identity)


def test_a_slim_vocabulary_scores_only_its_tokens(tiny_target):
    """The slim tier over a draft head's vocabulary: the same logits as the full LM head on its
    tokens, −inf elsewhere; the cache advances exactly as a full-vocabulary pass would."""
    from tierspec.cached_model import SlimVocabulary

    tokens = torch.tensor([3, 17, 42, 8, 8, 19])
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1)])
    full, slim = CachedModel(tiny_target.model), CachedModel(tiny_target.model)
    reference = full.forward(tokens, logits_for=3, mask=mask).logits
    subset = torch.tensor([0, 5, 9, 33, 63])
    restricted = slim.forward(tokens, logits_for=3, mask=mask, vocabulary=SlimVocabulary(tiny_target.model, subset)).logits
    assert torch.allclose(restricted[:, subset], reference[:, subset], atol=1e-9)
    outside = torch.ones(64, dtype=torch.bool)
    outside[subset] = False
    assert torch.isneginf(restricted[:, outside]).all()
    assert slim.length == full.length == 6 and slim.layer_lengths() == full.layer_lengths()
    everything = SlimVocabulary(tiny_target.model, torch.arange(64))
    assert torch.allclose(CachedModel(tiny_target.model).forward(tokens, logits_for=3, mask=mask, vocabulary=everything).logits,
                          reference, atol=1e-9)
    with pytest.raises(ModelLoadError, match="slim vocabulary ids"):
        SlimVocabulary(tiny_target.model, torch.tensor([64]))


def test_via_with_the_draft_heads_vocabulary_runs_its_slim_tier(tiny_target, prompt_ids):
    from tierspec.heads.draft import DraftHead

    head = DraftHead.for_target(tiny_target, torch.arange(0, 64, 2), seed=3).eval()
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    options = MethodOptions(mask=mask, drafter_kind="eagle", draft_head=head, slim_vocabulary="draft-head", num_draft=3)
    method = build_method("via", tiny_target, options=options)
    assert method.slim_vocabulary is not None and method.slim_vocabulary.token_ids.tolist() == list(range(0, 64, 2))
    seen = []
    tokens = run_ids(tiny_target, method, prompt_ids, 30, on_step=lambda step: seen.append(step.cycle))
    assert len(tokens) == 30 and sum(cycle.slim_calls for cycle in seen) > 0


def test_methods_built_on_one_model_share_its_forward_cost_table(tiny_target):
    """The forward-cost table, whose read-back runs a timed spot check, is read once per model, not
    once per method or generation, whatever their num_draft."""
    first = build_method("adaptive-pld", tiny_target, options=MethodOptions(num_draft=2))
    second = build_method("adaptive-pld", tiny_target, options=MethodOptions(num_draft=7))
    tables = {id(m.generation(n).policy.pass_costs) for m in (first, second) for n in (None, 1, 9)}
    assert len(tables) == 1 and first.generation().policy.pass_costs is not None
