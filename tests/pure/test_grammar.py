"""The grammar state (tierspec/grammar.py): planted masks checked by hand, advance and rollback
exact against a token-by-token walk, forced tokens, the end token, batched and tree masks, and
constrained greedy / sampled decoding whose every output parses and validates."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
import torch
from conftest import tiny_llama
from grammar_fixtures import EOS, ByteTokenizer, allowed_ids, constrained_ar

from tierspec.grammar import (
    GrammarError,
    GrammarSpec,
    compile_grammar,
    draft_masks,
    mask_logits,
    unpack_masks,
)

FLAT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def compiled_for(tok, spec):
    return compile_grammar(spec, tok, len(tok), [EOS])


def walk(tok, state, rng: random.Random, steps: int) -> list[int]:
    """A random path the grammar allows (the state is left at its end)."""
    taken = []
    for _ in range(steps):
        choices = sorted(allowed_ids(state) - {EOS})
        if not choices:
            break
        token = rng.choice(choices)
        assert state.advance([token]) == 1
        taken.append(token)
    return taken


# -- planted masks ------------------------------------------------------------------------------------------
def test_flat_schema_masks_by_hand(tok):
    state = compiled_for(tok, GrammarSpec.json_schema(FLAT)).new_state()
    digits = {tok.token(d) for d in "0123456789"}
    expected_before = [  # the allowed set before each token of '{"a": 12, "b": true}'
        ('{"', {tok.token('{"')}),  # forced: '{' alone is refused (the merge is the canonical token)
        ("a", {tok.token("a")}),
        ('":', {tok.token('":')}),
        (" ", {tok.token(" ")}),
        ("1", digits | {tok.token("-")}),
        ("2", digits | {tok.token(",")}),  # after "1": more digits, or the next key
        (",", digits | {tok.token(",")}),
        (' "', {tok.token(' "')}),
        ("b", {tok.token("b")}),
        ('":', {tok.token('":')}),
        (" ", {tok.token(" ")}),
        ("true", {tok.token(t) for t in ("f", "t", "tr", "tru", "true")}),
        ("}", {tok.token("}")}),
    ]
    assert [tok.decode([t]) for t in tok.encode('{"a": 12, "b": true}')] == [text for text, _ in expected_before]
    for text, allowed in expected_before:
        assert allowed_ids(state) == allowed, text
        assert not state.accepting()
        assert state.advance([tok.token(text)]) == 1
    assert allowed_ids(state) == {EOS}  # complete: only the end
    assert state.accepting() and state.stopped() and not state.finished()  # the end token is still to come


def test_enum_allows_each_value_and_nothing_else(tok):
    state = compiled_for(tok, GrammarSpec.json_schema({"enum": ["red", "green", 7]})).new_state()
    assert allowed_ids(state) == {tok.token('"'), tok.token("7")}
    state.advance([tok.token('"')])
    assert allowed_ids(state) == {tok.token("r"), tok.token("g")}
    state.advance(tok.encode("gre"))
    assert allowed_ids(state) == {tok.token("e")}


def test_regex_and_lark(tok):
    state = compiled_for(tok, GrammarSpec.regex(r"[0-9]{2}-(ab|cd)")).new_state()
    assert state.advance(tok.encode("12-c")) == 4
    assert allowed_ids(state) == {tok.token("d")}
    state.advance([tok.token("d")])
    assert allowed_ids(state) == {EOS}
    lark = compiled_for(tok, GrammarSpec.lark('start: "yes" | "no" | "n/a"')).new_state()
    assert allowed_ids(lark) == {tok.token("y"), tok.token("n")}
    lark.advance([tok.token("n")])
    assert allowed_ids(lark) == {tok.token("o"), tok.token("/")}


def test_json_object_mode_takes_any_object_and_only_objects(tok):
    compiled = compiled_for(tok, GrammarSpec.json_object())
    text = json.dumps({"x": [1, 2.5, None, {"y": "z"}], "t": True})
    state = compiled.new_state()
    assert state.advance(tok.encode(text)) == len(tok.encode(text)) and state.accepting()
    assert compiled.new_state().advance(tok.encode("[1]")) == 0


# -- advance / rollback exactness ------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_advance_equals_token_by_token_and_rollback_reproduces_masks(tok, seed):
    rng = random.Random(seed)
    compiled = compiled_for(tok, GrammarSpec.json_object())
    stepwise = compiled.new_state()
    masks, forced, accepting = [], [], []
    path = []
    for _ in range(40):
        masks.append(stepwise.allowed())
        forced.append(stepwise.forced())
        accepting.append(stepwise.accepting())
        step = walk(tok, stepwise, rng, 1)
        if not step:
            break
        path += step
    chunked = compiled.new_state()
    at = 0
    while at < len(path):  # the same path in random chunks
        size = rng.randint(1, 6)
        assert chunked.advance(path[at:at + size]) == len(path[at:at + size])
        at += size
    assert torch.equal(chunked.allowed(), stepwise.allowed())
    assert chunked.position == stepwise.position == len(path)
    for _ in range(12):  # roll back to random points, compare, and come forward again
        back = rng.randint(0, chunked.position)
        chunked.rollback(back)
        point = chunked.position
        assert torch.equal(chunked.allowed(), masks[point])
        assert chunked.forced() == forced[point] and chunked.accepting() == accepting[point]
        assert chunked.advance(path[point:]) == len(path) - point
        assert torch.equal(chunked.allowed(), stepwise.allowed())


def test_advance_stops_before_a_refused_token_and_stays_usable(tok):
    state = compiled_for(tok, GrammarSpec.json_schema(FLAT)).new_state()
    good = tok.encode('{"a": 1')
    before = None
    assert state.valid_prefix(good + [tok.token("x")] + good) == len(good)
    assert state.position == 0  # valid_prefix changes nothing
    taken = state.advance(good + [tok.token("x")] + tok.encode(", "))
    assert taken == len(good) and state.position == len(good)
    before = state.allowed()
    assert state.advance([tok.token("x")]) == 0
    assert torch.equal(state.allowed(), before)
    assert state.advance(tok.encode(', "b": false}')) == len(tok.encode(', "b": false}'))


def test_the_end_token_only_when_complete_and_rollback_across_it(tok):
    state = compiled_for(tok, GrammarSpec.regex("[0-9]+")).new_state()
    assert state.advance([EOS]) == 0  # empty text is not complete
    assert state.advance(tok.encode("12") + [EOS, tok.token("3")]) == 3  # stops after the end
    assert state.ended and state.position == 3 and allowed_ids(state) == {EOS}
    state.rollback(1)
    assert not state.ended and allowed_ids(state) == {EOS} | {tok.token(d) for d in "0123456789"}
    # a finished grammar (nothing but the end may follow): end, roll back, the masks are as before
    flat = compiled_for(tok, GrammarSpec.json_schema(FLAT)).new_state()
    text = tok.encode('{"a": 1, "b": true}')
    flat.advance(text)
    assert allowed_ids(flat) == {EOS} and flat.forced() == [EOS]
    assert flat.advance([EOS]) == 1
    flat.rollback(2)
    assert allowed_ids(flat) == {tok.token("}")}
    assert flat.advance(text[-1:] + [EOS]) == 2


def test_ids_outside_the_vocabulary_are_refused_and_change_nothing(tok):
    state = compiled_for(tok, GrammarSpec.regex("[ab]+")).new_state()
    state.advance([tok.token("a")])
    for bad in (len(tok), -1):
        with pytest.raises(ValueError, match=f"token id {bad} is outside the vocabulary \\(0 .. {len(tok) - 1}\\)"):
            state.advance([tok.token("b"), bad])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            state.valid_prefix([bad])
    assert state.position == 1 and state.advance([tok.token("b"), EOS]) == 2


def test_rollback_refuses_more_than_taken(tok):
    state = compiled_for(tok, GrammarSpec.json_schema(FLAT)).new_state()
    state.advance(tok.encode('{"a'))
    with pytest.raises(ValueError, match="cannot roll back 3 tokens: the state has taken 2"):
        state.rollback(3)
    assert state.position == 2 and allowed_ids(state) == {tok.token('":')}


# -- forced tokens ---------------------------------------------------------------------------------------------
def forced_run_is_certain(tok, state) -> list[int]:
    """Check that each of ``state.forced()`` is the only token allowed at its step; returns them
    (the state is left where it was)."""
    forced = state.forced()
    position = state.position
    for token in forced:
        assert allowed_ids(state) == {token}
        assert state.advance([token]) == 1
    state.rollback(state.position - position)
    return forced


def test_forced_tokens_of_fixed_keys_are_each_the_only_one_allowed(tok):
    schema = {"type": "object", "properties": {"kind": {"const": "cat"}, "n": {"type": "integer"}},
              "required": ["kind", "n"], "additionalProperties": False}
    state = compiled_for(tok, GrammarSpec.json_schema(schema)).new_state()
    forced = forced_run_is_certain(tok, state)
    assert tok.decode(forced) == '{"kind": "cat", "n": ' == tok.decode(state.fast_forward())
    assert state.forced(limit=2) == forced[:2] and state.position == 0
    state.advance(forced)
    assert forced_run_is_certain(tok, state) == []  # the number is free
    state.advance(tok.encode("4"))
    assert forced_run_is_certain(tok, state) == []  # more digits may come
    state.advance([tok.token("}")])
    assert state.forced() == [EOS] and state.fast_forward() == []
    state.advance([EOS])
    assert state.forced() == [] and state.fast_forward() == []


def test_forced_stops_where_the_forced_bytes_have_two_tokenisations(tok):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    state = compiled_for(tok, GrammarSpec.json_schema(schema)).new_state()
    # After '{"name":' the bytes ' "' are forced, but ' "' and ' ' + '"' both spell them (the
    # string after them is free): the engine's fast-forward stops there, and so does forced.
    assert tok.decode(forced_run_is_certain(tok, state)) == '{"name":'
    state.advance(state.forced())
    assert allowed_ids(state) == {tok.token(" "), tok.token(' "')}
    assert state.forced() == []


# -- batched and tree masks -----------------------------------------------------------------------------
def test_draft_masks_of_several_sequences_equal_one_by_one(tok):
    compiled = compiled_for(tok, GrammarSpec.json_schema(FLAT))
    text = tok.encode('{"a": 12, "b": true}')
    states, drafts = [], []
    for cut, draft in ((0, text[:4]), (4, text[4:7]), (7, text[7:9] + [tok.token("x")] + text[9:11]),
                       (len(text) - 1, [text[-1], EOS, tok.token("1")]), (len(text), [])):
        state = compiled.new_state()
        state.advance(text[:cut])
        states.append(state)
        drafts.append(draft)
    masks = draft_masks(states, drafts)
    assert masks.valid == (4, 3, 2, 2, 0)
    for i, (state, draft) in enumerate(zip(states, drafts)):
        rows = masks.rows(i)
        assert rows.shape == (len(draft) + 1, len(tok))
        position = state.position
        for j in range(masks.valid[i] + 1):
            assert torch.equal(rows[j], state.allowed()), (i, j)
            if j < masks.valid[i]:
                assert state.advance([draft[j]]) == 1
        state.rollback(state.position - position)
        assert not rows[masks.valid[i] + 1:].any()  # the refused draft's later rows: nothing


def test_tree_masks_equal_each_path_walked_alone(tok):
    state = compiled_for(tok, GrammarSpec.json_schema(FLAT)).new_state()
    state.advance(tok.encode('{"a": '))
    t = tok.token
    #            0        1        2        3        4        5         6        7
    tokens = [t("1"), t("-"), t("x"), t("2"), t(","), t("3"), t(' "'), t("}")]
    parents = [-1, -1, -1, 0, 0, 1, 4, 3]  # breadth-first: node 7 ("}") under node 3 is refused
    allowed, valid = state.tree_allowed(tokens, parents)
    assert valid.tolist() == [True, True, False, True, True, True, True, False]
    assert torch.equal(allowed[0], state.allowed())
    for node in range(len(tokens)):
        path, at = [], node
        while at >= 0:
            path.insert(0, tokens[at])
            at = parents[at]
        alone = state.copy()
        if valid[node]:
            assert alone.advance(path) == len(path)
            assert torch.equal(allowed[1 + node], alone.allowed()), node
        else:
            assert alone.advance(path) < len(path) and not allowed[1 + node].any()
    assert state.position == 4  # unchanged


# -- masks applied to logits ------------------------------------------------------------------------------
def test_unpack_and_mask_logits():
    rng = np.random.default_rng(0)
    bits = rng.random((3, 70)) < 0.3  # 70: not a multiple of 32
    words = np.packbits(np.pad(bits, ((0, 0), (0, 26))), axis=1, bitorder="little").view(np.int32)
    assert words.shape == (3, 3)
    allowed = unpack_masks(words, 70)
    assert allowed.tolist() == bits.tolist()
    logits = torch.randn(3, 70)
    masked = mask_logits(logits, allowed)
    assert torch.equal(masked[allowed], logits[allowed]) and torch.isneginf(masked[~allowed]).all()


# -- errors -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    (lambda: GrammarSpec.json_schema({"type": "array", "uniqueItems": True}),
     "the JSON schema uses keywords tierspec cannot enforce: uniqueItems"),
    (lambda: GrammarSpec.json_schema({"type": "integer", "if": {"minimum": 1}, "then": {"maximum": 3}}),
     "cannot enforce: if, then"),
    (lambda: GrammarSpec.json_schema({"type": "strin"}), "invalid JSON schema: Invalid type: strin"),
    (lambda: GrammarSpec.json_schema({"$ref": "#/$defs/none"}), "invalid JSON schema: Pointer '/$defs/none' does not exist"),
    (lambda: GrammarSpec.json_schema("{not json"), "the JSON schema is not valid JSON"),
    (lambda: GrammarSpec.json_schema([1]), "a JSON schema is an object"),
    (lambda: GrammarSpec.regex("[0-9"), "invalid regular expression"),
    (lambda: GrammarSpec.regex("([a"), "invalid regular expression: .*unclosed character class"),  # the detail kept
    (lambda: GrammarSpec.lark("start: missing_rule"), "invalid Lark grammar"),
    # compiled, but no text: each failed mid-generation ("NoExtensionBias"), a server's 500
    (lambda: GrammarSpec.regex(r"[^\s\S]"), "the regular expression matches no text"),
    (lambda: GrammarSpec.lark("start: A\nA: /a/ & /b/"), "the Lark grammar matches no text"),
    (lambda: GrammarSpec.json_schema(False), "the JSON schema false admits no value"),
])
def test_unsupported_or_invalid_grammars_are_named(tok, spec, message):
    with pytest.raises(GrammarError, match=message.replace("$", r"\$").replace("(", r"\(")):
        compiled_for(tok, spec())


@pytest.mark.parametrize("schema, place", [
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"},
                                       "tags": {"type": "array", "items": {"type": "string", "pattern": "(x"}}}},
     '/properties/tags/items/pattern ("(x")'),
    ({"type": "object", "patternProperties": {"[a-": {"type": "string"}}}, '/patternProperties/[a- ("[a-")'),
    # a property named "pattern" is a schema: its own pattern is the fault
    ({"type": "object", "properties": {"pattern": {"type": "string", "pattern": "a{2,1}"}}},
     '/properties/pattern/pattern ("a{2,1}")'),
    ({"$defs": {"a/b": {"type": "string", "pattern": "[z"}}, "$ref": "#/$defs/a~1b"}, '/$defs/a~1b/pattern ("[z")'),
])
def test_a_schemas_bad_pattern_is_named_by_its_place(tok, schema, place):
    """llguidance names a regex's fault but not where in the schema it sits."""
    with pytest.raises(GrammarError) as refused:
        compiled_for(tok, GrammarSpec.json_schema(schema))
    message = str(refused.value)
    assert message.startswith(f"invalid JSON schema: the pattern at {place}: regex parse error") and "\n" not in message


def test_a_schemas_own_options_cannot_turn_off_enforcement(tok):
    # llguidance reads options from "x-guidance"; tierspec's overrides win, so "lenient" (ignore
    # unimplemented keywords) cannot make an unenforced keyword pass silently.
    with pytest.raises(GrammarError, match="uniqueItems"):
        compiled_for(tok, GrammarSpec.json_schema({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}))
    # nor "coerce_one_of", which enforced an overlapping oneOf as anyOf: text valid under both branches
    overlapping = {"oneOf": [{"type": "number"}, {"type": "integer"}]}
    with pytest.raises(GrammarError, match="oneOf") as refused:
        compiled_for(tok, GrammarSpec.json_schema({**overlapping, "x-guidance": {"coerce_one_of": True}}))
    assert "coerce_one_of" not in str(refused.value)  # nor advised to switch it on


def test_the_schema_true_is_any_json_value(tok):
    compiled = compiled_for(tok, GrammarSpec.json_schema(True))
    for text in ('{"a": [1, 2]}', "3", '"x"', "null"):
        state = compiled.new_state()
        ids = tok.encode(text)
        assert state.advance(ids + [EOS]) == len(ids) + 1, text


# -- constrained decoding on a tiny random model: every output parses and validates ------------------------
SCHEMAS = [
    FLAT,
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 8},
        "people": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False}}},
     "required": ["title", "people"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "neutral"]},
                                      "score": {"type": "integer", "minimum": -5, "maximum": 5},
                                      "note": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["mood", "score"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def byte_model(tok):
    return tiny_llama(seed=3, vocab_size=len(tok), layers=2, hidden=32, sharpness=8.0)


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested", "enum-bounds"])
@pytest.mark.parametrize("seed", [None, 0, 1])
def test_constrained_decoding_on_a_random_model_always_validates(tok, byte_model, schema, seed):
    compiled = compiled_for(tok, GrammarSpec.json_schema(schema))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out = constrained_ar(byte_model.model, tok.encode("json: "), compiled, 200, {EOS}, generator)
    assert out[-1] == EOS, "the grammar ended within 200 tokens"
    value = json.loads(tok.decode(out[:-1]))
    jsonschema.validate(value, schema)
    assert tok.decode(out[:-1]) == json.dumps(value, ensure_ascii=False)  # the layout is json.dumps's


# -- the vocabulary -----------------------------------------------------------------------------------------------
def test_a_wider_model_vocabulary_forbids_the_ids_past_the_tokenizer(tok):
    compiled = compile_grammar(GrammarSpec.regex("[ab]"), tok, len(tok) + 37, [EOS])
    allowed = compiled.new_state().allowed()
    assert allowed.shape == (len(tok) + 37,) and not allowed[len(tok):].any()
    assert set(torch.nonzero(allowed).flatten().tolist()) == {tok.token("a"), tok.token("b")}


def test_the_engine_tokenizer_is_built_once_per_tokenizer(tok):
    from tierspec.grammar import engine_tokenizer

    assert engine_tokenizer(tok, len(tok), [EOS]) is engine_tokenizer(tok, len(tok), [EOS])
    assert engine_tokenizer(tok, len(tok) + 1, [EOS]) is not engine_tokenizer(tok, len(tok), [EOS])
    with pytest.raises(GrammarError, match="end-of-sequence ids \\[999\\] are outside the vocabulary of 265"):
        engine_tokenizer(tok, len(tok), [999])
    with pytest.raises(GrammarError, match="needs the model's end-of-sequence token"):
        engine_tokenizer(tok, len(tok), [])


@pytest.mark.real_model
def test_forced_keys_on_the_default_models_vocabulary():
    """SmolLM2's 49,152 tokens: the keys of a fixed schema are forced, each the only token
    its step allows; the free value is not."""
    from tierspec.gguf_cache import converted_copy
    from tierspec.models import default_model_file
    from tierspec.tokenizer import FastTokenizer

    real = FastTokenizer(converted_copy(default_model_file()))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    state = compile_grammar(GrammarSpec.json_schema(schema), real, len(real), [real.eos_token_id]).new_state()
    assert [real.decode([t]) for t in state.forced()] == ['{"', "name", '":']
    for token in state.forced():
        assert allowed_ids(state) == {token}
        state.advance([token])
    assert state.forced() == [] and len(allowed_ids(state)) > 2  # the string may start many ways
    state.advance(real.encode(' "Bob",', add_special_tokens=False))
    assert [real.decode([t]) for t in state.forced()] == [' "', "age", '":']
    state.advance(state.forced() + real.encode(" 7}", add_special_tokens=False))
    assert state.forced() == [real.eos_token_id] and state.advance([real.eos_token_id]) == 1


# -- special tokens: a mask allows only what the state takes ---------------------------------------------
@pytest.fixture(scope="module")
def tok_sep():
    """The byte-level tokenizer with a second special token, ``<sep>`` (not an end token)."""
    tokenizer = ByteTokenizer()
    tokenizer.backend.add_special_tokens(["<sep>"])
    tokenizer.size += 1
    return tokenizer


def test_an_end_tokens_text_is_not_text_and_a_grammar_of_it_alone_is_refused(tok):
    """llguidance let the end token into the mask where its text fits the regex; the state then
    refused it (the text is not complete): the server answered 500 to every request of the batch."""
    with pytest.raises(GrammarError, match="matches no text"):
        compiled_for(tok, GrammarSpec.regex("<eos>"))


def test_a_special_tokens_text_in_a_grammar_is_a_dead_end_said_by_name(tok_sep):
    sep = len(tok_sep) - 1
    state = compile_grammar(GrammarSpec.regex("ab<sep>c"), tok_sep, len(tok_sep), [EOS]).new_state()
    assert state.advance(tok_sep.encode("ab")) == 2
    assert not state.allowed().any()  # llguidance's own mask allows <sep> here, and then refuses to take it
    assert state.advance([sep]) == 0
    assert "'<sep>' (id " in state.dead_end() and "after 2 generated tokens" in state.dead_end()
    fresh = compile_grammar(GrammarSpec.regex("ab<sep>c"), tok_sep, len(tok_sep), [EOS]).new_state()
    assert fresh.dead_end() is None and fresh.allowed().any()


def test_a_special_token_a_lark_grammar_names_is_allowed_and_taken(tok_sep):
    sep = len(tok_sep) - 1
    state = compile_grammar(GrammarSpec.lark(f'start: "ab" <[{sep}]> "c"'), tok_sep, len(tok_sep), [EOS]).new_state()
    assert state.advance(tok_sep.encode("ab")) == 2
    assert allowed_ids(state) == {sep}
    assert state.advance([sep]) == 1 and state.advance(tok_sep.encode("c") + [EOS]) == 2


@pytest.mark.parametrize("spec", [lambda: GrammarSpec.regex("(a|b<sep>)c"), lambda: GrammarSpec.regex("[ab]{1,3}(<sep>)?"),
                                  lambda: GrammarSpec.json_schema({"type": "string", "pattern": "^x(<sep>|<eos>)?y$"})])
def test_every_token_a_mask_allows_is_taken_along_random_paths(tok_sep, spec):
    """Row masks and the batched draft masks (``draft_masks``) alike."""
    compiled = compile_grammar(spec(), tok_sep, len(tok_sep), [EOS])
    rng = random.Random(3)
    for _ in range(20):
        state = compiled.new_state()
        path = []
        for _ in range(8):
            allowed = sorted(allowed_ids(state))
            for token in allowed:  # each allowed token is taken (an end token where the text is complete)
                probe = state.copy()
                assert probe.advance([token]) == 1, (path, token)
            if not allowed or allowed == [EOS]:
                break
            token = rng.choice([t for t in allowed if t != EOS] or allowed)
            state.advance([token])
            path.append(token)
        start = compiled.new_state()
        masks = draft_masks([start], [path])
        assert masks.valid[0] == len(path)
        replay = compiled.new_state()
        for row in range(len(path) + 1):
            assert masks.rows(0)[row].tolist() == replay.allowed().tolist(), row
            if row < len(path):
                replay.advance([path[row]])


def test_a_grammar_naming_the_end_token_inside_its_text_is_told_to_end_there(tok):
    state = compile_grammar(GrammarSpec.lark(f'start: "ab" <[{EOS}]> "c"'), tok, len(tok), [EOS]).new_state()
    assert state.advance(tok.encode("ab")) == 2 and not state.allowed().any()
    assert "the end token ends the generation" in state.dead_end()


def test_a_pattern_key_in_a_schemas_data_is_not_taken_for_the_fault(tok):
    schema = {"type": "object", "default": {"pattern": "("}, "properties": {"id": {"type": "string", "pattern": "[z"}}}
    with pytest.raises(GrammarError, match=r'the pattern at /properties/id/pattern \("\[z"\)'):
        compiled_for(tok, GrammarSpec.json_schema(schema))
