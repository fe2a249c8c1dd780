"""Structured output through ``tierspec.generate`` / ``stream`` and ``tierspec generate``'s flags:
a JSON schema, JSON mode, a regex and a Lark grammar on a tiny random model over a byte-level
vocabulary (tests/grammar_fixtures.py); every lossless method gives constrained ``ar``'s text;
bad settings are one-line errors before anything runs."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from conftest import tiny_llama
from grammar_fixtures import EOS, ByteTokenizer

import tierspec
from tierspec import cli
from tierspec.errors import PromptError, TierspecError
from tierspec.grammar import GrammarError
from tierspec.models import wrap_model

pytestmark = pytest.mark.usefixtures("pinned_pass_costs")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def byte_target():
    tok = ByteTokenizer()
    model = tiny_llama(seed=5, vocab_size=len(tok), layers=3, hidden=32, sharpness=6.0, dtype=torch.float32).model
    model.config.eos_token_id = EOS
    model.generation_config.eos_token_id = EOS
    return wrap_model(model, tok, name="byte-llama")


@pytest.fixture(scope="module")
def prompt():
    return ByteTokenizer().encode('{"ok": true, "tag": "red"} {"ok": false, "tag": "green"} ')


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_with_a_json_schema_validates_and_every_method_is_ars(byte_target, prompt, temperature):
    outs = [tierspec.generate(prompt, target=byte_target, method=m, json_schema=SCHEMA, max_new_tokens=40,
                              temperature=temperature, seed=3) for m in ("ar", "pld", "adaptive-pld")]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids and outs[0].token_ids[-1] == EOS
    jsonschema.validate(json.loads(outs[0].text), SCHEMA)
    # the schema as JSON text, and stream's pieces, give the same
    text_stream = tierspec.stream(prompt, target=byte_target, method="pld", json_schema=json.dumps(SCHEMA),
                                  max_new_tokens=40, temperature=temperature, seed=3)
    assert "".join(text_stream) == outs[0].text


def test_json_mode_regex_and_lark(byte_target, prompt):
    from tierspec.grammar import GrammarSpec, compile_grammar

    out = tierspec.generate(prompt, target=byte_target, method="pld", json_object=True, max_new_tokens=30)
    state = compile_grammar(GrammarSpec.json_object(), byte_target.tokenizer, byte_target.vocab_size, [EOS]).new_state()
    # a random model writes long keys: the 30 tokens are an object's beginning, each one the grammar allows
    assert out.text.startswith("{") and state.advance(out.token_ids) == len(out.token_ids) == 30
    text = tierspec.generate(prompt, target=byte_target, method="pld", regex=r"(yes|no)-[0-9]{2}", max_new_tokens=20).text
    assert re.fullmatch(r"(yes|no)-[0-9]{2}", text)
    text = tierspec.generate(prompt, target=byte_target, method="pld", grammar='start: "a" ("b" | "c")+ "."',
                             max_new_tokens=20).text
    assert re.fullmatch(r"a[bc]+\.", text)


def test_a_generation_says_whether_its_budget_cut_it(byte_target, prompt):
    """``finish_reason``: "stop" at the end token or a complete constraint, "length" at the budget —
    the only way a caller could tell a cut (invalid) constrained text was reading the last id."""
    whole = tierspec.generate(prompt, target=byte_target, method="pld", json_schema=SCHEMA, max_new_tokens=40)
    cut = tierspec.generate(prompt, target=byte_target, method="pld", json_schema=SCHEMA, max_new_tokens=6)
    assert (whole.finish_reason, cut.finish_reason) == ("stop", "length") and whole.token_ids[-1] == EOS
    regex = tierspec.generate(prompt, target=byte_target, method="pld", regex=r"(yes|no)-[0-9]{2}", max_new_tokens=20)
    assert regex.finish_reason == "stop"  # the regex complete: the constraint ended it
    exact = len(regex.token_ids) - 1  # the budget ends it at its last byte, before the end token it would force
    whole_text = tierspec.generate(prompt, target=byte_target, method="pld", regex=r"(yes|no)-[0-9]{2}",
                                   max_new_tokens=exact)
    assert whole_text.text == regex.text and whole_text.finish_reason == "stop"  # complete, so not cut
    batch = tierspec.generate([prompt, prompt], target=byte_target, method="pld", json_schema=SCHEMA,
                              max_new_tokens=6)
    assert [g.finish_reason for g in batch] == ["length", "length"]
    text_stream = tierspec.stream(prompt, target=byte_target, method="pld", json_schema=SCHEMA, max_new_tokens=6)
    assert text_stream.finish_reason is None  # not yet run
    list(text_stream)
    assert text_stream.finish_reason == "length"


def test_the_cli_fails_a_constrained_text_its_budget_cut(monkeypatch, capsys, byte_target):
    """Printed, but exit 1 and said: the text is not valid under its constraint (exit 0 before)."""
    monkeypatch.setattr("tierspec.models.load_model", lambda spec, *a, **k: byte_target)
    assert cli.main(["generate", "x", "--json-schema", json.dumps(SCHEMA), "--max-new-tokens", "4", "--method", "pld",
                     "--no-chat-template"]) == 1
    assert "before its constraint was complete: it is not valid" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--max-new-tokens", "4", "--method", "pld", "--no-chat-template"]) == 0


def test_a_batch_of_constrained_prompts_keeps_each_solo_text(byte_target, prompt):
    alone = [tierspec.generate(p, target=byte_target, method="pld", json_schema=SCHEMA, max_new_tokens=30).token_ids
             for p in (prompt, prompt[5:])]
    batch = tierspec.generate([prompt, prompt[5:]], target=byte_target, method="pld", json_schema=SCHEMA,
                              max_new_tokens=30)
    assert [g.token_ids for g in batch] == alone


def test_bad_structured_settings_are_one_line_errors(byte_target, prompt):
    with pytest.raises(PromptError, match="at most one of json_schema, json_object, regex and grammar"):
        tierspec.generate(prompt, target=byte_target, json_object=True, regex="a")
    with pytest.raises(GrammarError, match="cannot enforce: uniqueItems"):
        tierspec.generate(prompt, target=byte_target, json_schema={"type": "array", "uniqueItems": True})
    with pytest.raises(GrammarError, match="not valid JSON"):
        tierspec.generate(prompt, target=byte_target, json_schema="{oops")
    with pytest.raises(TierspecError, match="cannot decode under a constraint"):
        tierspec.generate(prompt, target=byte_target, method="lossy", json_object=True)


def test_the_cli_checks_its_structured_flags_before_loading(capsys, tmp_path):
    assert cli.main(["generate", "hi", "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "neither a file nor a JSON schema" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--json", "--regex", "a+"]) == 2
    assert "at most one of" in capsys.readouterr().err
    assert cli.main(["generate", "hi", "--json-schema", "{bad"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--json-schema", str(schema)])
    assert json.loads(cli._structured_flags(args)["json_schema"]) == SCHEMA
    args = parser.parse_args(["generate", "hi", "--grammar", str(tmp_path / "none.lark")])
    with pytest.raises(PromptError, match="no such file"):
        cli._structured_flags(args)
