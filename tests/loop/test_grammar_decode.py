"""Real grammars (llguidance: a JSON schema, a regex) through the decode cycle, on a tiny random
model over a byte-level BPE vocabulary (tests/grammar_fixtures.py): every lossless method's
constrained tokens equal constrained ``ar``'s, greedy and seeded at t=1; greedy equals a plain
constrained loop written without tierspec's; the text validates and ends with the end token;
forced tokens (keys, braces, quotes) are drafted free and always kept, the drafter not asked where
the grammar forces the next token; the masks of a batch's chains come from one parallel call."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from conftest import tiny_llama
from grammar_fixtures import EOS, ByteTokenizer, constrained_ar

from tierspec.decode import DecodeConfig, DecodeRun, decode
from tierspec.grammar import GrammarSpec, GrammarState, compile_grammar
from tierspec.heads.draft import DraftHead
from tierspec.methods import MethodOptions, build_method
from tierspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("pinned_pass_costs")  # tests/conftest.py

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{2,4}!"


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return tiny_llama(seed=5, vocab_size=len(tok), layers=3, hidden=32, sharpness=6.0, dtype=torch.float32)


@pytest.fixture(scope="module")
def own_target(target, tmp_path_factory):
    """The same weights on tierspec's own Llama forward (token trees run on it)."""
    from tierspec.models import load_model

    folder = tmp_path_factory.mktemp("grammar-own") / "m"
    target.model.save_pretrained(folder)
    return load_model(folder, dtype="float32", implementation="tierspec")


@pytest.fixture(scope="module")
def grammars(tok, target):
    return {"schema": compile_grammar(GrammarSpec.json_schema(SCHEMA), tok, target.vocab_size, [EOS]),
            "regex": compile_grammar(GrammarSpec.regex(REGEX), tok, target.vocab_size, [EOS])}


def prompt(tok) -> torch.Tensor:
    # repeated JSON so that the n-gram drafters find matches
    return torch.tensor(tok.encode('{"ok": true, "n": 12, "tag": "red"} {"ok": false, "n": 7, "tag": "blue"} '))


def run(target, method, sampling, seed, grammar, tok, max_new=60):
    config = DecodeConfig(max_new_tokens=max_new, sampling=sampling, eos_token_ids=(EOS,), constraint=grammar)
    steps = list(decode(target, method, prompt(tok), config, seed))
    return [t for step in steps for t in step.new_tokens], steps


def check_text(tokens, tok, kind):
    assert tokens[-1] == EOS  # the end token came (forced once the grammar stopped)
    text = tok.decode(tokens[:-1])
    if kind == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        import re

        assert re.fullmatch(REGEX, text), text


LOSSLESS = ["ar", "forced", "sd", "adaptive-sd", "pld", "eagle", "hybrid", "self", "csd", "swift", "clasp", "pearl", "eagle-tree",
            "hybrid-tree"]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "t=1"])
@pytest.mark.parametrize("kind", ["schema", "regex"])
@pytest.mark.parametrize("name", LOSSLESS)
def test_every_lossless_methods_constrained_tokens_are_constrained_ars(name, kind, sampling, tok, target, own_target,
                                                                       grammars):
    from tierspec.layerskip.masks import RoutingMask

    model = own_target if name.endswith("-tree") or name == "clasp" else target
    options = {"draft_head": DraftHead.for_target(model, torch.arange(0, model.vocab_size, 2), seed=3).eval()} \
        if name in ("eagle", "hybrid", "eagle-tree", "hybrid-tree") else {}
    if name in ("self", "pearl"):
        options["mask"] = RoutingMask.from_units(3, "sublayer", [("mlp", 1)])
    if name in ("swift", "clasp"):
        options["confidence_threshold"] = 0.0  # draft every block in full: the drafts meet the grammar
        options[f"{name}_ratio"] = 0.3  # two of the 3-layer model's six sub-layers skipped
    if name == "pearl":
        options["pearl_gamma"] = 3
    drafter = tiny_llama(seed=22, vocab_size=len(tok), layers=1, hidden=32, sharpness=6.0, dtype=torch.float32) \
        if name in ("sd", "adaptive-sd", "csd") else None
    method = build_method(name, model, drafter, MethodOptions(**options))
    reference, _ = run(model, build_method("ar", model), sampling, 7, grammars[kind], tok)
    tokens, steps = run(model, method, sampling, 7, grammars[kind], tok)
    assert tokens == reference
    check_text(tokens, tok, kind)
    assert steps[-1].finished
    if sampling.greedy:  # and both equal a plain constrained loop written without tierspec's
        assert tokens == constrained_ar(target.model, prompt(tok).tolist(), grammars[kind], 60, {EOS})


def test_forced_tokens_are_drafted_free_and_always_kept(tok, target, grammars):
    """``forced`` (drafting only what the grammar forces) under the schema: the keys, quotes and
    braces come as forced drafts, at no drafter call, each accepted; fewer passes than tokens.
    Plain ``ar`` emits the same tokens one a pass."""
    tokens, steps = run(target, build_method("forced", target), SamplingConfig(), 0, grammars["schema"], tok)
    check_text(tokens, tok, "schema")
    forced = [s for s in steps if s.proposal.forced]
    assert forced and all(s.proposal.drafter_calls == 0 for s in forced)
    for step in forced:  # every forced node was kept (the method drafts nothing of its own)
        assert step.verdict.accepted == step.proposal.forced == len(step.proposal)
    assert tok.decode([t for s in forced for t in s.proposal.tokens.tolist()]).startswith('{"ok": ')
    assert len(steps) < len(tokens) / 2  # more than half the text forced
    plain, plain_steps = run(target, build_method("ar", target), SamplingConfig(), 0, grammars["schema"], tok)
    assert plain == tokens and len(plain_steps) == len(plain)


def test_a_forced_root_skips_the_drafter_and_the_grammars_time_is_its_own(tok, target, grammars):
    """Where the grammar allows one continuation after the committed tokens, the drafter is not
    asked: the cycle's drafts are the forced tokens alone (no draft-head step), all kept; where it
    allows more, the head drafts. The constraint's own time is counted apart from drafting."""
    head = DraftHead.for_target(target, torch.arange(0, target.vocab_size, 2), seed=3).eval()
    method = build_method("eagle", target, None, MethodOptions(draft_head=head))
    tokens, steps = run(target, method, SamplingConfig(), 7, grammars["schema"], tok)
    check_text(tokens, tok, "schema")
    state = grammars["schema"].new_state()  # the state at each cycle's start
    forced_roots = drafted_roots = 0
    for step in steps:
        forced = state.forced()
        if forced:
            forced_roots += 1
            assert step.proposal.drafter_calls == 0 and step.proposal.forced == len(step.proposal) > 0
            assert step.proposal.tokens.tolist() == forced[: len(step.proposal)]
            assert step.verdict.accepted == len(step.proposal)
        else:
            drafted_roots += step.proposal.drafter_calls > 0
        assert state.advance(step.new_tokens) == len(step.new_tokens)
    assert forced_roots >= 3 and drafted_roots >= 1
    assert all(step.cycle.grammar_seconds > 0 for step in steps)
    run_stats = DecodeRun(target, method, prompt(tok), DecodeConfig(max_new_tokens=8, eos_token_ids=(EOS,)), 7).finish()
    assert run_stats.stats.grammar_seconds == 0.0  # unconstrained: no grammar time


def test_the_cost_aware_trim_is_told_the_forced_run_after_each_draft_length(tok, target, grammars, monkeypatch):
    """``CostAware.trim`` gets, for every draft length the grammar takes, the forced run that
    would follow it: checked against a fresh state walked over the committed tokens and drafts."""
    from tierspec.decode import FORCED_PER_CYCLE
    from tierspec.policies import CostAware

    seen, generated = [], []
    original = CostAware.trim

    def recording(self, proposal, forced_after=None):
        seen.append((list(generated), proposal.tokens.tolist(), forced_after))
        return original(self, proposal, forced_after)

    monkeypatch.setattr(CostAware, "trim", recording)
    # free words, each followed by a forced " ok ": the n-gram drafts run from a word into its forced tail
    words = compile_grammar(GrammarSpec.regex(r"((cat|cow|dog) ok ){2,6}end"), tok, target.vocab_size, [EOS])
    max_new = 60
    config = DecodeConfig(max_new_tokens=max_new, sampling=SamplingConfig(temperature=1.0), eos_token_ids=(EOS,),
                          constraint=words)
    method = build_method("adaptive-pld", target, None, MethodOptions())
    for step in decode(target, method, torch.tensor(tok.encode("cat ok dog ok cow ok cat ok dog ok cow ok ")), config, 7):
        generated.extend(step.new_tokens)
    assert generated[-1] == EOS and tok.decode(generated[:-1]).endswith(" ok end")
    told = [entry for entry in seen if entry[1]]
    assert told and any(sum(runs[1:]) for _, _, runs in told)  # some draft led into a forced run
    for before, drafts, runs in told:
        state = words.new_state()
        assert state.advance(before) == len(before)
        expected = []
        for j in range(len(drafts) + 1):
            room = max(0, min(FORCED_PER_CYCLE, max_new - len(before) - 1 - j))
            expected.append(len(state.forced()[:room]))
            if j == len(drafts) or state.advance([drafts[j]]) != 1:
                break
        assert runs == expected


def test_a_batchs_chain_masks_come_from_one_parallel_call(tok, target, grammars, monkeypatch):
    """Three constrained generations (and an unconstrained one) in one batch keep their solo text;
    each cycle fills the masks of all the grammar chains in one ``chain_masks`` call."""
    from tierspec.batch import BatchDecoder

    calls = []
    original = GrammarState.chain_masks

    def counted(states, chains, out):
        calls.append(len(states))
        return original(states, chains, out)

    method = build_method("pld", target, None, MethodOptions(num_draft=4))
    base = prompt(tok)
    prompts = [base, base[4:], base[9:], base[2:]]
    configs = [DecodeConfig(max_new_tokens=40, sampling=SamplingConfig(t), eos_token_ids=(EOS,), constraint=g)
               for t, g in ((0.0, grammars["schema"]), (1.0, grammars["schema"]), (0.0, grammars["regex"]), (0.0, None))]
    alone = [DecodeRun(target, method, p, c, seed=i).finish().token_ids for i, (p, c) in enumerate(zip(prompts, configs))]
    monkeypatch.setattr(GrammarState, "chain_masks", staticmethod(counted))
    batch = BatchDecoder(target, max_batch=4)
    runs = [batch.add(i, method, p, c, seed=i) for i, (p, c) in enumerate(zip(prompts, configs))]
    while len(batch):
        batch.step()
    assert [run.token_ids for run in runs] == alone
    assert max(calls) == 3  # the three grammar sequences' chains together
    assert batch.times.grammar > 0 and batch.times.to_dict()["grammar"] == batch.times.grammar
    for run, kind in zip(runs[:3], ("schema", "schema", "regex")):
        check_text(run.token_ids, tok, kind)


def test_a_dead_end_ends_its_generation_with_an_error_and_the_batch_goes_on(tok):
    """A regex whose text goes on only with a special token's text: llguidance's masks let the special
    token in and then refused it (a ConstraintError: the server failed every generation of the batch)."""
    from tierspec.batch import BatchDecoder
    from tierspec.constraints import ConstraintDeadEnd

    tokenizer = ByteTokenizer()
    tokenizer.backend.add_special_tokens(["<sep>"])
    tokenizer.size += 1
    model = tiny_llama(seed=5, vocab_size=len(tokenizer), layers=3, hidden=32, sharpness=6.0, dtype=torch.float32)
    dead = compile_grammar(GrammarSpec.regex("ab<sep>c"), tokenizer, len(tokenizer), [EOS])
    base = torch.tensor(tokenizer.encode('{"ok": true, "n": 1} {"ok": true, "n": 1}'))
    method = build_method("pld", model, None, MethodOptions(num_draft=4))
    configs = [DecodeConfig(max_new_tokens=12, eos_token_ids=(EOS,), constraint=dead),
               DecodeConfig(max_new_tokens=12, eos_token_ids=(EOS,))]
    with pytest.raises(ConstraintDeadEnd, match=r"after 2 generated tokens.*'<sep>'"):
        DecodeRun(model, method, base, configs[0]).finish()
    solo = DecodeRun(model, method, base[3:], configs[1]).finish().token_ids
    batch = BatchDecoder(model, max_batch=2)
    failing, other = batch.add(0, method, base, configs[0]), batch.add(1, method, base[3:], configs[1])
    failed = []
    while len(batch):
        batch.step()
        failed += batch.take_failed()
    assert failed == [failing] and isinstance(failing.error, ConstraintDeadEnd) and failing.finish_reason() == "error"
    assert failing.token_ids == tokenizer.encode("ab") and other.token_ids == solo
