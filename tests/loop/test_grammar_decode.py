"""Real grammars (llguidance: a JSON schema, a regex) through the decode cycle, on a tiny random
model over a byte-level BPE vocabulary (tests/grammar_fixtures.py): every lossless method's
constrained tokens equal constrained ``ar``'s, greedy and seeded at t=1; greedy equals a plain
constrained loop written without tierspec's; the text validates and ends with the end token;
forced tokens (keys, braces, quotes) are drafted free and always kept; the masks of a batch's
chains come from one parallel call."""

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


LOSSLESS = ["ar", "sd", "pld", "eagle", "hybrid", "self", "csd", "eagle-tree", "hybrid-tree"]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)], ids=["greedy", "t=1"])
@pytest.mark.parametrize("kind", ["schema", "regex"])
@pytest.mark.parametrize("name", LOSSLESS)
def test_every_lossless_methods_constrained_tokens_are_constrained_ars(name, kind, sampling, tok, target, own_target,
                                                                       grammars):
    from tierspec.layerskip.masks import RoutingMask

    model = own_target if name.endswith("-tree") else target
    options = {"draft_head": DraftHead.for_target(model, torch.arange(0, model.vocab_size, 2), seed=3).eval()} \
        if name in ("eagle", "hybrid", "eagle-tree", "hybrid-tree") else {}
    if name == "self":
        options["mask"] = RoutingMask.from_units(3, "sublayer", [("mlp", 1)])
    drafter = tiny_llama(seed=22, vocab_size=len(tok), layers=1, hidden=32, sharpness=6.0, dtype=torch.float32) \
        if name in ("sd", "csd") else None
    method = build_method(name, model, drafter, MethodOptions(**options))
    reference, _ = run(model, build_method("ar", model), sampling, 7, grammars[kind], tok)
    tokens, steps = run(model, method, sampling, 7, grammars[kind], tok)
    assert tokens == reference
    check_text(tokens, tok, kind)
    assert steps[-1].finished
    if sampling.greedy:  # and both equal a plain constrained loop written without tierspec's
        assert tokens == constrained_ar(target.model, prompt(tok).tolist(), grammars[kind], 60, {EOS})


def test_forced_tokens_are_drafted_free_and_always_kept(tok, target, grammars):
    """Plain decoding under the schema: the keys, quotes and braces come as forced drafts, at no
    drafter call, each accepted; fewer passes than tokens."""
    tokens, steps = run(target, build_method("ar", target), SamplingConfig(), 0, grammars["schema"], tok)
    check_text(tokens, tok, "schema")
    forced = [s for s in steps if s.proposal.forced]
    assert forced and all(s.proposal.drafter_calls == 0 for s in forced)
    for step in forced:  # every forced node was kept (ar drafts nothing of its own)
        assert step.verdict.accepted == step.proposal.forced == len(step.proposal)
    assert tok.decode([t for s in forced for t in s.proposal.tokens.tolist()]).startswith('{"ok": ')
    assert len(steps) < len(tokens) / 2  # more than half the text forced


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
    for run, kind in zip(runs[:3], ("schema", "schema", "regex")):
        check_text(run.token_ids, tok, kind)
