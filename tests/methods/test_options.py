"""Every option honoured or refused (issue 37, item 3).

For every method option: a method that uses it shows its value in the parts a generation runs
with, and a method that does not use it refuses it (with a drafter model too). ``num_draft``, the
option the default method used to ignore, sizes the cost-aware methods' drafts through the API,
the command line and the server alike, and is refused by the methods it cannot size."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import shared_fixture, tiny_llama

import tierspec
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.heads.draft import DraftHead
from tierspec.heads.judge import JudgeHead
from tierspec.layerskip.masks import RoutingMask
from tierspec.methods import MethodOptionError, MethodOptions, build_method, option_fields

pytestmark = pytest.mark.usefixtures("pinned_pass_costs")  # tests/conftest.py

MASK = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
PROMPT = torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])


target = shared_fixture("target", "sampling_target")
own_target = shared_fixture("own_target", "sampling_own_target")


@pytest.fixture(scope="module")
def heads(target):
    hidden = target.identity.hidden_size
    judge = JudgeHead(torch.randn(hidden, generator=torch.Generator().manual_seed(1)), 0.0, torch.zeros(hidden),
                      torch.ones(hidden), "hidden", 0.5, target.identity)
    return {"draft": DraftHead.for_target(target, torch.arange(0, 64, 2), seed=3).eval(), "judge": judge}


def _parts(method):
    parts = method.generation()
    return parts.drafter, parts.policy, parts.rule


#: Per option: (a method that uses it, the value, the other options it needs, what a generation's
#: parts show of the value). Every option of ``MethodOptions`` has a row.
USES = {
    "num_draft": ("adaptive-pld", 3, {}, lambda d, p, r: p.max_draft == 3),
    "ngram_size": ("pld", 2, {}, lambda d, p, r: d.ngram_size == 2),
    "mask": ("self", MASK, {}, lambda d, p, r: d.mask is MASK),
    "confidence_threshold": ("self", 0.5, {"mask": MASK}, lambda d, p, r: p.threshold == 0.5),
    "swift_ratio": ("swift", 0.3, {}, lambda d, p, r: d.ratio == 0.3),
    "clasp_ratio": ("clasp", 0.3, {}, lambda d, p, r: d.ratio == 0.3),
    "clasp_interval": ("clasp", 4, {}, lambda d, p, r: d.interval == 4),
    "pearl_gamma": ("pearl", 2, {"mask": MASK}, lambda d, p, r: d.gamma == 2 and p.max_draft == 3),
    "pearl_threads": ("pearl", 0, {"mask": MASK}, lambda d, p, r: d.threads == 0),
    "drafter_kind": ("lossy", "self", {"draft_mask": MASK}, lambda d, p, r: type(d).__name__ == "SelfSpeculativeDrafter"),
    "draft_mask": ("lossy", MASK, {"drafter_kind": "self"}, lambda d, p, r: d.mask is MASK),
    "draft_head": ("eagle", "draft", {}, lambda d, p, r: d.head is not None),
    "alpha": ("lossy", 0.2, {}, lambda d, p, r: r.alpha == 0.2),
    "beta": ("lossy", 0.5, {}, lambda d, p, r: r.beta == 0.5),
    "fallback": ("bild", 0.5, {"drafter_kind": "model"}, lambda d, p, r: p.threshold == 0.5),
    "rollback": ("bild", 2.0, {}, lambda d, p, r: r.rollback == 2.0),
    "deferral": ("cascade", "chow", {"drafter_kind": "model"}, lambda d, p, r: r.deferral == "chow"),
    "alpha1": ("via", 0.4, {"mask": MASK, "drafter_kind": "model"}, lambda d, p, r: r.alpha1 == 0.4),
    "alpha2": ("via", 0.4, {"mask": MASK}, lambda d, p, r: r.alpha2 == 0.4),
    "max_target_lag": ("via", 3, {"mask": MASK}, lambda d, p, r: r.max_target_lag == 3),
    "csd_model_positions": ("csd", 2, {}, lambda d, p, r: d.model_positions == 2),
    "csd_inner_draft": ("csd", 2, {}, lambda d, p, r: d.inner_draft == 2),
    "judge_head": ("judge", "judge", {}, lambda d, p, r: r.head is not None),
    "judge_threshold": ("judge", 0.3, {"judge_head": "judge"}, lambda d, p, r: r.threshold == 0.3),
    "sampling_rule": ("pld", "residual", {}, lambda d, p, r: r.sampling_rule == "residual"),
    "slim_vocabulary": ("via", "draft-head", {"mask": MASK, "draft_head": "draft"}, lambda d, p, r: True),
}


def test_every_option_has_a_row():
    assert set(USES) == {option.name for option in option_fields()}


def _options(heads, **values) -> MethodOptions:
    named = {"draft": heads["draft"], "judge": heads["judge"]}
    return MethodOptions(**{k: named.get(v, v) if isinstance(v, str) else v for k, v in values.items()})


@pytest.mark.parametrize("option", list(USES))
def test_an_option_shows_in_the_parts_of_a_method_that_uses_it(option, target, own_target, heads):
    name, value, needs, shows = USES[option]
    model = own_target if name == "clasp" else target
    method = build_method(name, model, None, _options(heads, **{**needs, option: value}))
    assert shows(*_parts(method))
    if option == "slim_vocabulary":
        assert method.slim_vocabulary is not None


@pytest.mark.parametrize("option", list(USES))
def test_a_method_that_does_not_use_an_option_refuses_it(option, target, heads):
    _, value, _, _ = USES[option]
    # pld uses num_draft, ngram_size and sampling_rule: ar uses neither of the first two, a lossy rule no sampling rule
    other = {"num_draft": "ar", "sampling_rule": "lossy", "ngram_size": "ar"}.get(option, "pld")
    with pytest.raises(MethodOptionError, match=f"does not use {option}|takes no num_draft"):
        build_method(other, target, None, _options(heads, **{option: value}))
    build_method(other, target, None, _options(heads, **{option: value}), strict=False)  # a server's pooled options


def test_a_drafter_model_a_method_never_drafts_with_is_refused(target):
    drafter = tiny_llama(seed=22, layers=1, sharpness=6.0, dtype=torch.float32)
    for name in ("pld", "ar", "adaptive-pld"):
        with pytest.raises(MethodOptionError, match="drafts without a drafter model"):
            build_method(name, target, drafter)
    for name in ("sd", "adaptive-sd", "csd"):
        build_method(name, target, drafter)
    build_method("lossy", target, drafter)  # auto: the drafter model
    with pytest.raises(MethodOptionError, match="drafts without a drafter model"):
        build_method("lossy", target, drafter, MethodOptions(drafter_kind="ngram"))


# ---- every option changes the run it says it changes ------------------------------------------------

OTHER_MASK = RoutingMask.from_units(4, "sublayer", [("attn", 1), ("mlp", 2)])

#: Per option: (method, the options of two runs that differ in it, temperature). The runs must differ
#: in what the option governs — their tokens, drafts, acceptances, calls or deciders (``_observed``),
#: none of their timings. ``pearl_threads`` is not here: it sets when PEARL's drafts are made (beside
#: the target's pass, or before it with 0), not which — the same drafts by design; the table above
#: checks that it reaches the drafter. Confidence-stopped drafters run with threshold 0 where the
#: option is not the threshold (the tiny model is rarely confident: they would draft nothing).
SURE = {"confidence_threshold": 0.0}
CHANGES = {
    "num_draft": ("adaptive-pld", ({}, {"num_draft": 1}), 0.0),
    "ngram_size": ("pld", ({}, {"ngram_size": 1}), 0.0),  # on NGRAM_PROMPT: its 3-gram and 1-gram matches differ
    "mask": ("self", ({"mask": MASK, **SURE}, {"mask": OTHER_MASK, **SURE}), 0.0),
    "confidence_threshold": ("self", ({"mask": MASK, **SURE}, {"mask": MASK, "confidence_threshold": 1.0}), 0.0),
    "swift_ratio": ("swift", (SURE, {"swift_ratio": 0.1, **SURE}), 0.0),
    "clasp_ratio": ("clasp", (SURE, {"clasp_ratio": 0.1, **SURE}), 0.0),
    "clasp_interval": ("clasp", (SURE, {"clasp_interval": 1, **SURE}), 0.0),
    # both given: the default is derived from the weights' bytes (1 for this mask on the tiny model)
    "pearl_gamma": ("pearl", ({"mask": MASK, "pearl_gamma": 1}, {"mask": MASK, "pearl_gamma": 4}), 0.0),
    "drafter_kind": ("lossy", ({"drafter_kind": "ngram"}, {"drafter_kind": "model"}), 0.0),
    "draft_mask": ("lossy", ({"drafter_kind": "self", "draft_mask": MASK, **SURE},
                             {"drafter_kind": "self", "draft_mask": OTHER_MASK, **SURE}), 0.0),
    "draft_head": ("eagle", ({"draft_head": "draft"}, {"draft_head": "other draft"}), 0.0),
    "alpha": ("lossy", ({}, {"alpha": 0.9}), 0.0),
    # β shapes the draw after a rejection: a drafter model of its own (the masked target agrees with the
    # tiny target too well to be rejected), and α = 0 for many rejections
    "beta": ("lossy", ({"alpha": 0.0, "drafter_model": True}, {"alpha": 0.0, "beta": 0.05, "drafter_model": True}), 1.0),
    "fallback": ("bild", ({"drafter_kind": "model", "fallback": 0.0}, {"drafter_kind": "model", "fallback": 1.0}), 0.0),
    "rollback": ("bild", ({"drafter_kind": "model", "fallback": 0.0},
                          {"drafter_kind": "model", "fallback": 0.0, "rollback": 0.01}), 1.0),
    "deferral": ("cascade", ({"drafter_kind": "model", "alpha": 0.9}, {"drafter_kind": "model", "alpha": 0.9,
                                                                      "deferral": "chow"}), 1.0),
    "alpha1": ("via", ({"mask": MASK, "drafter_kind": "model", "alpha2": 1.0, "alpha1": 0.0},
                       {"mask": MASK, "drafter_kind": "model", "alpha2": 1.0, "alpha1": 1.0}), 1.0),
    "alpha2": ("via", ({"mask": MASK, "drafter_kind": "model", "alpha2": 0.0},
                       {"mask": MASK, "drafter_kind": "model", "alpha2": 1.0}), 1.0),
    "max_target_lag": ("via", ({"mask": MASK, "drafter_kind": "model", "alpha2": 1.0},
                               {"mask": MASK, "drafter_kind": "model", "alpha2": 1.0, "max_target_lag": 0}), 0.0),
    "csd_model_positions": ("csd", ({}, {"csd_model_positions": 1}), 0.0),
    "csd_inner_draft": ("csd", ({}, {"csd_inner_draft": 0}), 0.0),
    "judge_head": ("judge", ({"judge_head": "judge", "judge_threshold": 0.5},
                             {"judge_head": "other judge", "judge_threshold": 0.5}), 1.0),
    "judge_threshold": ("judge", ({"judge_head": "judge", "judge_threshold": 0.0},
                                  {"judge_head": "judge", "judge_threshold": 1.0}), 1.0),
    "sampling_rule": ("pld", ({}, {"sampling_rule": "residual"}), 1.0),
    "slim_vocabulary": ("via", ({"mask": MASK, "drafter_kind": "model", "alpha2": 1.0},
                                {"mask": MASK, "drafter_kind": "model", "alpha2": 1.0, "draft_head": "draft",
                                 "slim_vocabulary": "draft-head"}), 1.0),
}
#: Its last 3-gram (1 2 3) was last followed by 4, its last token (3) by 7: lookup of 3 and of 1 drafts apart.
NGRAM_PROMPT = torch.tensor([1, 2, 3, 4, 11, 12, 13, 9, 3, 7, 8, 20, 1, 2, 3])


def test_every_option_but_one_has_a_change_to_show():
    assert set(CHANGES) | {"pearl_threads"} == {option.name for option in option_fields()}


@pytest.fixture(scope="module")
def other_heads(target):
    hidden = target.identity.hidden_size
    judge = JudgeHead(-torch.randn(hidden, generator=torch.Generator().manual_seed(9)), 2.0, torch.zeros(hidden),
                      torch.ones(hidden), "hidden", 0.5, target.identity)
    return {"other draft": DraftHead.for_target(target, torch.arange(1, 64, 2), seed=8).eval(), "other judge": judge}


def _observed(model, method, temperature, prompt):
    """What a run did, none of its timings: per cycle its tokens, drafts, acceptances, calls and deciders."""
    config = DecodeConfig(max_new_tokens=32, sampling=tierspec.SamplingConfig(temperature))
    return [(step.new_tokens, step.proposal.token_list, step.cycle.accepted, step.cycle.target_calls, step.cycle.slim_calls,
             step.cycle.drafter_calls, tuple(step.cycle.deciders))
            for step in DecodeRun(model, method, prompt, config, seed=5)]


@pytest.mark.parametrize("option", list(CHANGES))
def test_an_option_changes_the_run_it_governs(option, target, own_target, heads, other_heads, sampling_drafter):
    name, both, temperature = CHANGES[option]
    model = own_target if name == "clasp" else target
    named = {**heads, **other_heads}
    runs = []
    for given in both:
        given = dict(given)
        drafter = sampling_drafter if given.pop("drafter_model", False) else None
        options = MethodOptions(**{k: named.get(v, v) if isinstance(v, str) else v for k, v in given.items()})
        runs.append(_observed(model, build_method(name, model, drafter, options), temperature,
                              NGRAM_PROMPT if option == "ngram_size" else PROMPT))
    assert runs[0] != runs[1], f"{option}: {both[0]} and {both[1]} ran the same"


# ---- options a method's drafter makes moot ------------------------------------------------------------


@pytest.mark.parametrize("name, values, needs", [
    ("cascade", {"deferral": "chow"}, {}),
    ("cascade", {"alpha": 0.4}, {}),
    ("bild", {"fallback": 0.9}, {}),
    ("via", {"alpha1": 0.9}, {"mask": MASK}),
    ("via-judge", {"alpha1": 0.9}, {"mask": MASK, "judge_head": "judge"}),
])
def test_a_gate_an_ngram_drafter_makes_moot_is_refused(name, values, needs, target, heads):
    """Without a drafter distribution the gates take one branch whatever they are set to (cascade
    defers every position, VIA-SD's δ1 is 1, BiLD has no confidence to stop on): refused, and taken
    with a drafter that has one."""
    with pytest.raises(MethodOptionError, match=r"does not use .* here: the drafter \(n-gram lookup\) has no distribution"):
        build_method(name, target, None, _options(heads, **needs, **values))
    build_method(name, target, None, _options(heads, **needs, **values, drafter_kind="model"))


def test_alpha_is_refused_with_the_deferral_that_ignores_it(target, heads):
    with pytest.raises(MethodOptionError, match="does not use alpha .*'always' defers every position"):
        build_method("cascade", target, None, MethodOptions(deferral="always", alpha=0.3, drafter_kind="model"))


@pytest.mark.parametrize("name", ["ar", "forced"])
def test_a_sampling_rule_is_refused_where_nothing_is_drafted_to_keep(name, target):
    with pytest.raises(MethodOptionError, match="does not use sampling_rule"):
        build_method(name, target, None, MethodOptions(sampling_rule="residual"))


def _run_stats(target, method, temperature=1.0):
    """(the tokens, drafted, accepted, the tiers' shares): what a run did, none of its timings."""
    config = DecodeConfig(max_new_tokens=32, sampling=tierspec.SamplingConfig(temperature))
    run = DecodeRun(target, method, PROMPT, config, seed=5).finish()
    stats = run.stats
    return run.token_ids, stats.drafted, stats.accepted, stats.tier_fractions()


def test_the_gates_change_what_they_gate(target, heads):
    """Each gate option changes the run it gates (not only the object it is stored in): BiLD's
    fallback with the draft head (it used to draft by the cost-aware policy whatever the fallback),
    cascade's deferral and VIA-SD's α1 with a drafter model."""
    head = {"drafter_kind": "eagle", "draft_head": heads["draft"]}
    low = build_method("bild", target, None, MethodOptions(fallback=0.0, **head))
    high = build_method("bild", target, None, MethodOptions(fallback=1.0, **head))
    assert _run_stats(target, low)[1] > 0 == _run_stats(target, high)[1]
    model = {"drafter_kind": "model"}
    runs = {deferral: _run_stats(target, build_method("cascade", target, None, MethodOptions(deferral=deferral, **alpha,
                                                                                             **model)))
            for deferral, alpha in (("always", {}), ("chow", {"alpha": 0.9}))}
    assert runs["always"] != runs["chow"]
    # α2 = 1: the slim tier never defers to the target, so α1 alone picks the draft's or the slim distribution
    slim = {alpha1: _run_stats(target, build_method("via", target, None, MethodOptions(mask=MASK, alpha1=alpha1, alpha2=1.0,
                                                                                       **model)))
            for alpha1 in (0.0, 1.0)}
    assert slim[0.0] != slim[1.0]


# ---- num_draft on every face ------------------------------------------------------------------------


def _longest_drafts(target, method, num_draft, temperature=0.0) -> int:
    config = DecodeConfig(max_new_tokens=40, sampling=tierspec.SamplingConfig(temperature), num_draft=num_draft)
    return max(len(step.proposal) for step in DecodeRun(target, method, PROMPT, config, seed=3))


@pytest.mark.parametrize("name", ["hybrid", "eagle", "adaptive-pld", "pld", "sd", "self", "eagle-tree"])
def test_num_draft_sizes_each_generation_of_one_method(name, target, own_target, heads):
    """One method object, generations with num_draft 1 and 6: the drafts follow each (the issue's
    finding: --num-draft 1 and 8 drafted the same tokens with hybrid)."""
    model = own_target if name.endswith("-tree") else target
    options = {"draft_head": DraftHead.for_target(model, torch.arange(0, 64, 2), seed=3).eval()} \
        if name in ("hybrid", "eagle", "eagle-tree") else {}
    if name == "self":
        options.update(mask=MASK, confidence_threshold=0.0)
    drafter = tiny_llama(seed=22, layers=1, sharpness=6.0, dtype=torch.float32) if name == "sd" else None
    method = build_method(name, model, drafter, MethodOptions(**options))
    short, long = _longest_drafts(model, method, 1), _longest_drafts(model, method, 6)
    if name.endswith("-tree"):  # a tree's num_draft is its depth
        config = DecodeConfig(max_new_tokens=40, num_draft=1)
        assert max(s.proposal.tree.depth for s in DecodeRun(model, method, PROMPT, config)) <= 1
    else:
        assert short <= 1
    assert long <= 6 and method.generation(6).policy.max_draft == 6
    if name not in ("eagle", "eagle-tree"):  # an untrained head's drafts need not pay for its policy
        assert long > 1
    assert _longest_drafts(model, method, 0) == 0  # num_draft 0: plain decoding


@pytest.mark.parametrize("name", ["ar", "pearl"])
def test_num_draft_is_refused_where_it_cannot_size_the_drafts(name, target):
    method = build_method(name, target, None, MethodOptions(mask=MASK) if name == "pearl" else MethodOptions())
    with pytest.raises(MethodOptionError, match="takes no num_draft"):
        _longest_drafts(target, method, 3)
    with pytest.raises(MethodOptionError, match="takes no num_draft"):
        build_method(name, target, None, MethodOptions(num_draft=3, **({"mask": MASK} if name == "pearl" else {})))


def test_the_api_honours_num_draft(target):
    """``generate(num_draft=...)`` sizes the default cost-aware method's drafts."""
    drafted = {}
    for num_draft in (1, 6):
        out = tierspec.generate(PROMPT.tolist(), target=target, method="adaptive-pld", num_draft=num_draft,
                                max_new_tokens=40)
        drafted[num_draft] = len(out.stats.acceptance_by_position())
    assert drafted[1] <= 1 < drafted[6] <= 6
    with pytest.raises(MethodOptionError, match="takes no num_draft"):
        tierspec.generate(PROMPT.tolist(), target=target, method="ar", num_draft=2, max_new_tokens=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_drafts'"):
        tierspec.generate(PROMPT.tolist(), target=target, method="pld", num_drafts=2)


def test_generate_and_stream_take_the_one_declaration_of_their_settings():
    import inspect

    from tierspec.api import GenerationSettings

    declared = [field.name for field in dataclasses.fields(GenerationSettings)]
    for function in (tierspec.generate, tierspec.stream):
        assert list(inspect.signature(function).parameters)[1:] == declared


def test_the_command_line_honours_num_draft(monkeypatch, capsys, target):
    from conftest import char_tokenizer

    from tierspec import cli

    speaking = dataclasses.replace(target, tokenizer=char_tokenizer())
    monkeypatch.setattr("tierspec.models.load_model", lambda spec, *a, **k: speaking)
    lengths = {}
    for num_draft in ("1", "6"):
        assert cli.main(["generate", "abcabcabcabcabcabc", "--method", "adaptive-pld", "--num-draft", num_draft,
                         "--max-new-tokens", "40", "--stats", "--no-chat-template"]) == 0
        stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
        lengths[num_draft] = len(stats["acceptance_by_position"])
    assert lengths["1"] <= 1 < lengths["6"]
