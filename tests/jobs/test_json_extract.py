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


# ---- the set in the bench ------------------------------------------------------------------------------------


@pytest.fixture
def byte_target():
    import torch
    from conftest import tiny_llama

    from tierspec.models import wrap_model

    tok = ByteTokenizer()
    model = tiny_llama(seed=5, vocab_size=len(tok), layers=3, hidden=32, sharpness=6.0, dtype=torch.float32).model
    model.config.eos_token_id = model.generation_config.eos_token_id = EOS
    return wrap_model(model, tok, name="byte-llama")


PICK = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]}},
        "required": ["ok", "tag"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer"], "additionalProperties": False}


@pytest.fixture
def small_set(tmp_path):
    """A data folder holding a two-task set (an enum object; a bounded answer with its gold value)."""
    tasks = [{"id": "enums-00", "shape": "enums", "source": "planted", "prompt": '{"ok": true, "tag": "red"} ',
              "schema": PICK, "reference": None},
             {"id": "numbers-00", "shape": "numbers", "source": "planted", "prompt": '{"answer": 3} {"answer": ',
              "schema": ANSWER, "reference": {"answer": 3}}]
    write_tasks(tmp_path / "data" / TASKS_FILE, tasks)
    return tmp_path / "data"


def test_the_bench_constrains_each_prompt_to_its_schema(tmp_path, byte_target, small_set):
    """``--dataset json_extract``: every text follows its task's schema (the validity column 1.0),
    the lossless methods write ``ar``'s tokens, the answer column compares the gold answer, and the
    grammar's share of the time is reported apart from drafting."""
    from tierspec.bench.runner import BenchConfig, run_bench

    config = BenchConfig(target="byte", methods=("ar", "pld", "adaptive-pld"), dataset="json_extract",
                         per_category=1, max_new_tokens=40, data_dir=str(small_set))
    summary = run_bench(config, tmp_path / "out", progress=False, target=byte_target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 6
    schemas = {"json_extract/enums-00": PICK, "json_extract/numbers-00": ANSWER}
    for record in records:
        value = json.loads(record["text"])
        jsonschema.validate(value, schemas[record["prompt_id"]])
        assert record["json_valid"] == 1.0 and record["token_ids"][-1] == EOS and record["grammar_seconds"] > 0
        assert record["json_cut"] == 0.0
        if record["prompt_id"].endswith("numbers-00"):
            assert record["json_answer_match"] == float(value["answer"] == 3)
    for name in ("pld", "adaptive-pld"):
        overall = summary["methods"][name]["overall"]
        assert overall["fidelity_exact_match"] == 1.0 and overall["json_valid"] == 1.0
        assert overall["grammar_time_share"] > 0
    table = (tmp_path / "out" / "summary.md").read_text()
    assert "json_valid" in table and "| grammar |" in table


def test_a_text_the_budget_cuts_is_counted_apart(tmp_path, byte_target, small_set):
    """A budget too short for the schema: the texts are prefixes of valid objects, not valid, and
    ``json_cut`` says the budget ended them (it is 0.0 for a valid text: the first test's)."""
    from tierspec.bench.runner import BenchConfig, run_bench

    config = BenchConfig(target="byte", methods=("ar",), dataset="json_extract", per_category=1,
                         max_new_tokens=5, data_dir=str(small_set))
    summary = run_bench(config, tmp_path / "out", progress=False, target=byte_target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["emitted"] == 5 and record["token_ids"][-1] != EOS
        assert record["json_valid"] == 0.0 and record["json_cut"] == 1.0 and record["text"].startswith("{")
    assert summary["methods"]["ar"]["overall"]["json_cut"] == 1.0
    assert "json_cut" in (tmp_path / "out" / "summary.md").read_text()


@pytest.mark.real_model
def test_the_llama_cpp_peer_follows_each_schema_with_its_own_grammar(tmp_path, small_set):
    """On a constrained set ``llamacpp-greedy`` follows each task's schema through llama.cpp's own
    grammar (what its users run): valid texts, at least the enum's own value where free greedy
    text would not be JSON; constrained ``ar`` and ``forced`` beside it write the same tokens."""
    pytest.importorskip("llama_cpp")
    import tierspec
    from tierspec.bench.runner import BenchConfig, run_bench

    target = tierspec.load_model("smollm2-135m")
    config = BenchConfig(methods=("ar", "forced", "llamacpp-greedy"), dataset="json_extract", per_category=1,
                         max_new_tokens=40, data_dir=str(small_set), compute_nll=False)
    run_bench(config, tmp_path / "out", progress=False, target=target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    by = {(r["method"], r["prompt_id"]): r for r in records}
    assert len(records) == 6 and not any("error" in r for r in records)
    schemas = {"json_extract/enums-00": PICK, "json_extract/numbers-00": ANSWER}
    for prompt_id, schema in schemas.items():
        peer = by[("llamacpp-greedy", prompt_id)]
        jsonschema.validate(json.loads(peer["text"]), schema)
        assert peer["json_valid"] == 1.0
        assert by[("forced", prompt_id)]["token_ids"] == by[("ar", prompt_id)]["token_ids"]
        assert by[("forced", prompt_id)]["target_calls"] < by[("ar", prompt_id)]["target_calls"]


@pytest.mark.parametrize("methods, message", [
    (("ar", "hf-greedy"), "hf-greedy cannot do"),
    (("ar", "ov-greedy"), "ov-greedy cannot do"),
    (("ar", "lossy:alpha=0.3"), "cannot decode under a constraint"),
])
def test_the_bench_refuses_what_cannot_follow_a_schema(tmp_path, byte_target, small_set, methods, message):
    from tierspec.bench.runner import BenchConfig, BenchError, run_bench

    config = BenchConfig(target="byte", methods=methods, dataset="json_extract", per_category=1, max_new_tokens=8,
                         data_dir=str(small_set))
    with pytest.raises(BenchError, match=message):
        run_bench(config, tmp_path / "out", progress=False, target=byte_target)


def test_free_text_runs_the_same_prompts_unconstrained(tmp_path, byte_target, small_set):
    """``--free-text``: the set's prompts without their schemas (what a constrained run's speed is
    compared with): no grammar time, texts the model's own (this random byte model writes no valid
    object unconstrained), validity still scored; a set with no schemas refuses the flag."""
    from tierspec.bench.runner import BenchConfig, BenchError, run_bench

    config = BenchConfig(target="byte", methods=("ar", "pld"), dataset="json_extract", per_category=1,
                         max_new_tokens=12, data_dir=str(small_set), free_text=True)
    run_bench(config, tmp_path / "out", progress=False, target=byte_target)
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(record["grammar_seconds"] == 0 for record in records)
    assert any(record["json_valid"] == 0.0 for record in records)
    from dataclasses import replace  # free and constrained records in one folder would be averaged together

    with pytest.raises(BenchError, match="free_text: True → False"):
        run_bench(replace(config, free_text=False), tmp_path / "out", progress=False, target=byte_target)
    with pytest.raises(BenchError, match="--free-text leaves a constrained set's texts free; spec_bench constrains none"):
        run_bench(BenchConfig(target="byte", methods=("ar",), free_text=True), tmp_path / "other", progress=False,
                  target=byte_target)
