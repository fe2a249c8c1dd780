"""The JSON-extraction set: prompts that ask for fields of a passage as a JSON object matching a
schema, built from the shipped evaluation data, and the validity check the bench's column uses.

52 tasks of five shapes (``SHAPES``), each from one shipped file:

- ``mt_bench`` (10): MT-Bench's extraction questions, each with a schema written for it (arrays
  of objects, integer ratings with bounds, enums of categories, nested lists);
- ``nested`` (12): CNN/DailyMail articles → people with roles, organisations, places (arrays of
  objects and of strings, bounded lengths);
- ``enums`` (12): XSum articles → topic and tone (enums), a headline, a year (integer, bounded,
  nullable);
- ``numbers`` (12): GSM8K problems → the quantities given and the answer (numbers with bounds;
  the gold answer kept as the reference);
- ``optional`` (6): Spec-Bench's open questions (Natural Questions) → an answer, an optional
  confidence in [0, 1] and optional sources (required and optional keys).

Stored as ``tierspec/datasets/json_extract/tasks.jsonl.gz`` (``python -m tierspec.bench.json_extract
--build`` writes it again from the other shipped files, the same bytes); SOURCES.md there names
the sources and licences. ``load_tasks`` reads it; ``check_output`` says whether a model's text
parses as JSON and validates against the task's schema.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..data import JSON_EXTRACT_FILE, DataError, default_data_dir, read_jsonl

TASKS_FILE = JSON_EXTRACT_FILE
SHAPES = ("mt_bench", "nested", "enums", "numbers", "optional")
PASSAGE_CHARS = 1500  # passages are cut at a sentence end before this many characters


@dataclass(frozen=True)
class ExtractionTask:
    """One task: ``prompt`` is the user message (the instruction, the schema and the passage);
    ``reference`` the gold fields where the source has them (GSM8K's answer), else None."""

    id: str
    shape: str
    source: str  # the shipped file and record it was built from
    prompt: str
    schema: dict
    reference: dict | None = None


@dataclass(frozen=True)
class Validity:
    """Whether a model's text is a JSON value (``parsed``) that validates against the schema
    (``valid``); ``error``: why not, in one line; ``value``: the parsed value."""

    parsed: bool
    valid: bool
    error: str | None = None
    value: object = None


def check_output(schema: dict, text: str) -> Validity:
    """Parse ``text`` as JSON (surrounding whitespace allowed, nothing else) and validate it
    against ``schema`` (JSON Schema draft 2020-12)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as error:
        return Validity(False, False, f"not JSON: {error}")
    validator = jsonschema.Draft202012Validator(schema)
    problem = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if problem is not None:
        where = "/".join(str(part) for part in problem.absolute_path) or "the top level"
        return Validity(True, False, f"at {where}: {problem.message}", value)
    return Validity(True, True, None, value)


def load_tasks(data_dir: Path | None = None) -> list[ExtractionTask]:
    """The shipped tasks (from ``data_dir``, default the packaged data)."""
    rows = read_jsonl((data_dir or default_data_dir()) / TASKS_FILE)
    try:
        return [ExtractionTask(row["id"], row["shape"], row["source"], row["prompt"], row["schema"], row.get("reference"))
                for row in rows]
    except (KeyError, TypeError) as error:
        raise DataError(f"{TASKS_FILE} has a malformed task: {error}") from error


# -- building the set from the shipped files -------------------------------------------------------------
def _obj(properties: dict, required: list[str] | None = None) -> dict:
    """An object schema with exactly ``properties`` (no others), all required unless ``required``."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


def _text(max_length: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_length}


def _strings(max_items: int, max_length: int = 60) -> dict:
    return {"type": "array", "items": _text(max_length), "maxItems": max_items}


def _prompt(instruction: str, schema: dict, passage: str | None = None) -> str:
    text = f"{instruction}\nReply with one JSON object that matches this JSON schema:\n{json.dumps(schema)}"
    return text + (f"\n\nPassage:\n{passage}" if passage else "")


def _passage(text: str, limit: int = PASSAGE_CHARS) -> str:
    """The first sentences of ``text`` within ``limit`` characters (at least one sentence's worth)."""
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= limit:
        return text
    cut = max(text.rfind(". ", 0, limit), text.rfind('." ', 0, limit))
    return text[: cut + 1] if cut > limit // 3 else text[:limit]


# MT-Bench's extraction questions (ids 131-140), each with the schema its instruction asks for.
MT_BENCH_SCHEMAS = {
    131: _obj({"ratings": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5},
                           "minItems": 3, "maxItems": 3}}),
    132: _obj({"topics": {"type": "array", "items": {"enum": ["Literature", "History", "Science", "Art"]},
                          "minItems": 4, "maxItems": 4}}),
    133: _obj({"books": {"type": "array", "maxItems": 3, "items": _obj({
        "main_character": _text(60), "book": _text(80), "author": _text(60),
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})}}),
    134: _obj({"company": _text(40), "ceo": _text(60), "profit_billions": {"type": "number", "minimum": 0}}),
    135: _obj({"countries": {"type": "array", "maxItems": 3, "items": _obj({
        "country": _text(40), "capital": _text(40), "language": _text(40)})}}),
    136: _obj({"counts": {"type": "array", "maxItems": 3, "items": _obj({
        "word": {"enum": ["Amazon", "river", "you"]}, "appearances": {"type": "integer", "minimum": 0, "maximum": 100}})}}),
    137: _obj({"people": _strings(8), "organizations": _strings(8), "locations": _strings(8)}),
    138: _obj({"iPhone": {"type": "number", "minimum": 1, "maximum": 10},
              "Samsung Galaxy": {"type": "number", "minimum": 1, "maximum": 10},
              "Google Pixel": {"type": "number", "minimum": 1, "maximum": 10}}),
    139: _obj({"equations": {"type": "array", "maxItems": 3, "items": _obj({
        "equation": {"type": "integer", "minimum": 1, "maximum": 3}, "variables": _strings(12, 20)})}}),
    140: _obj({"months": {"type": "array", "maxItems": 12, "items": _obj({
        "month": {"type": "string", "pattern": "^2022-(0[1-9]|1[0-2])$"},
        "highest_close": {"type": "number", "minimum": 0}, "lowest_close": {"type": "number", "minimum": 0}})}}),
}

NESTED_SCHEMA = _obj({
    "headline": _text(120),
    "people": {"type": "array", "maxItems": 5, "items": _obj({"name": _text(60), "role": _text(60)})},
    "organisations": _strings(5),
    "places": _strings(5),
})
TOPICS = ["politics", "business", "sport", "science", "health", "crime", "culture", "world", "other"]
ENUM_SCHEMA = _obj({
    "topic": {"enum": TOPICS},
    "tone": {"enum": ["positive", "negative", "neutral"]},
    "headline": _text(100),
    "year": {"type": ["integer", "null"], "minimum": 1900, "maximum": 2030},
})
NUMBER_SCHEMA = _obj({
    "quantities": {"type": "array", "maxItems": 6, "items": _obj({
        "what": _text(40), "value": {"type": "number", "minimum": -1000000, "maximum": 1000000}})},
    "answer": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
})
OPTIONAL_SCHEMA = _obj({
    "answer": _text(80),
    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "sources": _strings(3),
}, required=["answer"])


def build_tasks(data_dir: Path | None = None, per_source: int = 12) -> list[dict]:
    """The task records, in a fixed order, from the shipped files under ``data_dir``."""
    root = data_dir or default_data_dir()
    tasks: list[dict] = []

    def add(shape, source, prompt, schema, reference=None):
        tasks.append({"id": f"{shape}-{len([t for t in tasks if t['shape'] == shape]):02d}", "shape": shape,
                      "source": source, "prompt": prompt, "schema": schema, "reference": reference})

    questions = {row["question_id"]: row for row in read_jsonl(root / "mt_bench" / "question.jsonl")}
    for number, schema in MT_BENCH_SCHEMAS.items():
        add("mt_bench", f"mt_bench/question.jsonl question_id {number}",
            _prompt(questions[number]["turns"][0], schema), schema)
    for row in read_jsonl(root / "cnn_dailymail" / "test.jsonl")[:per_source]:
        add("nested", f"cnn_dailymail/test.jsonl id {row['id']}",
            _prompt("Extract the headline, the people named (with their role), the organisations and the "
                    "places from the news article below.", NESTED_SCHEMA, _passage(row["article"])), NESTED_SCHEMA)
    for row in read_jsonl(root / "xsum" / "test.jsonl")[:per_source]:
        add("enums", f"xsum/test.jsonl id {row['id']}",
            _prompt("Classify the BBC article below by topic and tone, give it a short headline, and give the "
                    "year it mentions (null if none).", ENUM_SCHEMA, _passage(row["document"])), ENUM_SCHEMA)
    for index, row in enumerate(read_jsonl(root / "gsm8k" / "test.jsonl")[:per_source]):
        answer = int(row["answer"].rsplit("####", 1)[1].strip().replace(",", ""))
        add("numbers", f"gsm8k/test.jsonl line {index}",
            _prompt("List the quantities the problem below gives, then solve it: the answer is a whole number.",
                    NUMBER_SCHEMA, row["question"]), NUMBER_SCHEMA, {"answer": answer})
    spec_bench = [row for row in read_jsonl(root / "spec_bench" / "question.jsonl") if row["category"] == "qa"]
    for row in spec_bench[: per_source // 2]:
        add("optional", f"spec_bench/question.jsonl question_id {row['question_id']}",
            _prompt(f"Answer the question: {row['turns'][0]}\nGive your confidence if you can, and sources if "
                    "you know them.", OPTIONAL_SCHEMA), OPTIONAL_SCHEMA)
    return tasks


def write_tasks(path: Path, tasks: list[dict]) -> None:
    """Write ``tasks`` as gzip JSONL, the same bytes for the same tasks (no timestamp in the
    header), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(task, ensure_ascii=False) + "\n" for task in tasks).encode()
    staging = path.with_name(path.name + ".tmp")
    with open(staging, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as handle:
        handle.write(data)
    staging.replace(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build or check the JSON-extraction task set.")
    parser.add_argument("--build", action="store_true", help="write tasks.jsonl.gz again from the shipped files")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    root = args.data_dir or default_data_dir()
    if args.build:
        tasks = build_tasks(root)
        write_tasks(root / TASKS_FILE, tasks)
        print(f"wrote {len(tasks)} tasks to {root / TASKS_FILE}")
    tasks = load_tasks(root)
    shapes = {shape: sum(task.shape == shape for task in tasks) for shape in SHAPES}
    print(f"{len(tasks)} tasks: " + ", ".join(f"{shape} {count}" for shape, count in shapes.items()))


if __name__ == "__main__":
    main()
