"""The JSON-extraction set (tierspec/bench/json_extract.py): what is shipped, that it is rebuilt
byte for byte from the other shipped files, that every schema is valid and compiles to a grammar,
the validity check on planted outputs, and constrained greedy decoding on the real model whose
every output validates."""

from __future__ import annotations

import json

import jsonschema
import pytest
from grammar_fixtures import EOS, ByteTokenizer

from tierspec.bench.json_extract import SHAPES, TASKS_FILE, build_tasks, check_output, load_tasks, write_tasks
from tierspec.data import PACKAGED_DATA
from tierspec.grammar import GrammarSpec, compile_grammar


@pytest.fixture(scope="module")
def tasks():
    return load_tasks(PACKAGED_DATA)


def test_the_shipped_set(tasks):
    assert len(tasks) == 52
    assert {shape: sum(t.shape == shape for t in tasks) for shape in SHAPES} == \
        {"mt_bench": 10, "nested": 12, "enums": 12, "numbers": 12, "optional": 6}
    assert len({t.id for t in tasks}) == len(tasks)
    for task in tasks:
        jsonschema.Draft202012Validator.check_schema(task.schema)
        assert json.dumps(task.schema) in task.prompt  # the model is shown the schema it must follow


def test_rebuilt_byte_for_byte_from_the_shipped_files(tmp_path):
    write_tasks(tmp_path / "tasks.jsonl.gz", build_tasks(PACKAGED_DATA))
    assert (tmp_path / "tasks.jsonl.gz").read_bytes() == (PACKAGED_DATA / TASKS_FILE).read_bytes()


def test_gsm8k_references_are_the_final_answers(tasks):
    numbers = [t for t in tasks if t.shape == "numbers"]
    assert numbers[0].reference == {"answer": 18}  # Janet's ducks: 16 - 3 - 4 = 9 eggs at $2
    assert all(isinstance(t.reference["answer"], int) for t in numbers)
    assert all(t.reference is None for t in tasks if t.shape != "numbers")


def test_every_schema_compiles_to_a_grammar(tasks):
    tok = ByteTokenizer()
    for task in tasks:
        state = compile_grammar(GrammarSpec.json_schema(task.schema), tok, len(tok), [EOS]).new_state()
        assert tok.decode(state.forced()).startswith("{"), task.id


@pytest.mark.parametrize("text, parsed, valid, error", [
    ('{"answer": "Paris"}', True, True, None),
    ('  {"answer": "Paris", "confidence": 0.9, "sources": []}\n', True, True, None),
    ('{"answer": "Paris"', False, False, "not JSON"),
    ('{"answer": "Paris"} and more', False, False, "not JSON"),
    ('{"confidence": 0.5}', True, False, "at the top level: 'answer' is a required property"),
    ('{"answer": "Paris", "confidence": 1.5}', True, False, "at confidence: 1.5 is greater than the maximum of 1"),
    ('{"answer": "Paris", "extra": 1}', True, False, "Additional properties are not allowed"),
    ('{"answer": ""}', True, False, "at answer: '' should be non-empty"),
])
def test_check_output_on_planted_texts(tasks, text, parsed, valid, error):
    schema = next(t.schema for t in tasks if t.shape == "optional")
    result = check_output(schema, text)
    assert (result.parsed, result.valid) == (parsed, valid)
    assert (result.error is None) if error is None else (error in result.error)


@pytest.mark.real_model
def test_constrained_greedy_on_the_real_model_always_validates(tasks):
    """One task of each shape, greedy under its schema's grammar with a plain cached loop: each
    output parses and validates (the bench's validity column at 100%)."""
    from grammar_fixtures import constrained_greedy_cached

    import tierspec
    from tierspec.prompting import encode_messages

    target = tierspec.load_model("smollm2-135m")
    eos = {target.tokenizer.eos_token_id}
    for shape in SHAPES:
        task = next(t for t in tasks if t.shape == shape)
        compiled = compile_grammar(GrammarSpec.json_schema(task.schema), target.tokenizer, target.vocab_size, eos)
        prompt = encode_messages(target, [{"role": "user", "content": task.prompt}]).tolist()
        out = constrained_greedy_cached(target.model, prompt, compiled, 400, eos)
        text = target.tokenizer.decode(out, skip_special_tokens=True)
        assert out[-1] in eos, f"{task.id}: no end within 400 tokens: {text!r}"
        result = check_output(task.schema, text)
        assert result.valid, f"{task.id}: {result.error}: {text!r}"
