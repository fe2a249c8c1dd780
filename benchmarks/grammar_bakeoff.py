"""Bake-off of grammar engines for structured output under speculation (issue 39, DESIGN.md §12).

Measures llguidance, xgrammar and outlines-core on the default model's 49,152-token vocabulary
(SmolLM2-135M-Instruct's ``tokenizer.json``, read from the GGUF's converted folder):

- install: version, dependencies it pulls in and their installed size;
- one-off tokenizer set-up per engine;
- time to compile a JSON schema (several shapes) to the first mask (compile + first mask: some
  engines build lazily, so "compiled" alone would not compare);
- time to compute one token's mask along a valid output, advancing token by token;
- advancing along a 4-token draft and rolling it back: supported?, cost, and whether the mask
  after the rollback equals the mask before it bitwise;
- masks of several sequences / draft positions in one call (batched), where offered;
- forced tokens (fast-forward) from a state;
- JSON Schema coverage: per keyword, whether a valid instance is accepted and an invalid one
  refused ("enforced"), both accepted ("ignored"), the schema refused at compile ("refused", with
  the message), or a valid instance refused ("wrong");
- regex and grammar (lark / EBNF) support.

All engines get the same language: compact JSON (separators "," and ":", no other whitespace),
``additionalProperties: false`` written in each schema. Run it in an environment holding all
three (xgrammar pulls triton, ~1 GB, so not into the project's own environment):

    python -m venv --system-site-packages /tmp/grammar-venv
    /tmp/grammar-venv/bin/pip install llguidance xgrammar outlines-core
    PYTHONPATH=. flock -x /tmp/tierspec-cpu.lock /tmp/grammar-venv/bin/python benchmarks/grammar_bakeoff.py

Writes results/grammar_bakeoff/bakeoff.json and bakeoff.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent.parent / "results" / "grammar_bakeoff"
COMPACT = (",", ":")
DRAFT = 4  # the draft length of the advance / rollback check

# -- the schemas timed (shape, schema, one valid instance) ---------------------------------------
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
ARTICLE = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "people": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "role": {"type": "string"}},
            "required": ["name", "role"], "additionalProperties": False}},
        "places": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["title", "people", "places"], "additionalProperties": False}
ENUMS = {
    "type": "object",
    "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "score": {"type": "integer", "minimum": 1, "maximum": 10},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "topic": {"type": "string", "enum": ["politics", "sport", "business", "science", "other"]},
    },
    "required": ["sentiment", "score", "confidence", "topic"], "additionalProperties": False}
OPTIONAL = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer"},
        "unit": {"type": "string", "maxLength": 12},
        "steps": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    },
    "required": ["answer", "steps"], "additionalProperties": False}
WIDE = {"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(20)},
        "required": [f"field_{i}" for i in range(20)], "additionalProperties": False}

SCHEMAS = {
    "flat (3 keys)": (PERSON, {"name": "Ada Lovelace", "age": 36, "member": True}),
    "nested arrays": (ARTICLE, {"title": "Storm hits the coast", "people": [
        {"name": "Jane Smith", "role": "mayor"}, {"name": "Tom Brown", "role": "forecaster"}],
        "places": ["Dover", "Kent"]}),
    "enums + bounded numbers": (ENUMS, {"sentiment": "negative", "score": 3, "confidence": 0.85, "topic": "sport"}),
    "optional + pattern": (OPTIONAL, {"answer": 42, "steps": ["6 times 7", "is 42"], "date": "2024-05-01"}),
    "wide (20 keys)": (WIDE, {f"field_{i}": (i if i % 3 == 0 else None if i % 3 == 1 else f"v{i}") for i in range(20)}),
}
JSON_MODE = ("json mode (any JSON)", {"answer": "the capital of France is Paris", "facts": [1, 2.5, None, True]})

# -- keyword coverage: (keyword, schema, valid instance, invalid instance) ---------------------
def _obj(props, required=None):
    return {"type": "object", "properties": props, "required": list(required if required is not None else props),
            "additionalProperties": False}


COVERAGE = [
    ("type (string)", {"type": "string"}, "abc", 3),
    ("enum", {"enum": ["red", "green"]}, "red", "blue"),
    ("const", {"const": "fixed"}, "fixed", "other"),
    ("minLength / maxLength", {"type": "string", "minLength": 2, "maxLength": 4}, "abc", "a"),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{3}$"}, "ABC", "abcd"),
    ("format: date", {"type": "string", "format": "date"}, "2024-01-31", "31 Jan"),
    ("format: email", {"type": "string", "format": "email"}, "a@b.co", "not an email"),
    ("minimum / maximum (integer)", {"type": "integer", "minimum": 1, "maximum": 10}, 7, 11),
    ("exclusiveMinimum (number)", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
    ("required / optional", _obj({"a": {"type": "integer"}, "b": {"type": "integer"}}, ["a"]), {"a": 1}, {"b": 1}),
    ("additionalProperties: false", _obj({"a": {"type": "integer"}}), {"a": 1}, {"a": 1, "z": 2}),
    ("additionalProperties: schema", {"type": "object", "additionalProperties": {"type": "integer"}}, {"x": 1}, {"x": "s"}),
    ("patternProperties", {"type": "object", "patternProperties": {"^n_": {"type": "integer"}},
                           "additionalProperties": False}, {"n_a": 1}, {"m": 1}),
    ("minProperties", {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     {"a": 1, "b": 2}, {"a": 1}),
    ("minItems / maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, [1, 2], [1, 2, 3]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     ["a", 1], [1, "a"]),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [1, 5], [1, 2]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s", None),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
    ("type list (nullable)", {"type": ["integer", "null"]}, None, "s"),
    ("$ref / $defs", {"$defs": {"p": _obj({"x": {"type": "integer"}})}, "type": "array", "items": {"$ref": "#/$defs/p"}},
     [{"x": 1}], [{"y": 1}]),
    ("recursive $ref", {"$defs": {"node": _obj({"v": {"type": "integer"}, "kids": {"type": "array",
                                                                               "items": {"$ref": "#/$defs/node"}}})},
                        "$ref": "#/$defs/node"}, {"v": 1, "kids": [{"v": 2, "kids": []}]}, {"v": 1, "kids": [{"v": "x"}]}),
    ("not", {"type": "integer", "not": {"const": 3}}, 4, 3),
    ("if / then / else", {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}, "else": True}, 12, 11),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}, "additionalProperties": False}, {"a": 1, "b": 2}, {"a": 1}),
]

REGEX = r"[0-9]{3}-[0-9]{4}"
REGEX_OK, REGEX_BAD = "555-1234", "55-12345"
LARK = 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]+/'
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]+'
GRAMMAR_OK, GRAMMAR_BAD = "maybe 42", "perhaps"


def dumps(value) -> str:
    return json.dumps(value, separators=COMPACT)


# -- the vocabulary ----------------------------------------------------------------------------
def byte_decoder() -> dict[str, int]:
    """The inverse of the byte-level BPE alphabet: each of the 256 bytes is written as one
    printable character (printable Latin-1 bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: byte for byte in printable}
    shift = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = 256 + shift
            shift += 1
    return {chr(code): byte for byte, code in chars.items()}


class Vocab:
    """The default model's tokenizer: its ``tokenizer.json`` text, tokens as bytes, special ids."""

    def __init__(self):
        from tierspec.gguf_cache import converted_copy
        from tierspec.models import default_model_file
        from tierspec.tokenizer import FastTokenizer

        self.folder = converted_copy(default_model_file())
        self.json_text = (self.folder / "tokenizer.json").read_text()
        self.tokenizer = FastTokenizer(self.folder)
        self.size = len(self.tokenizer)
        self.eos = self.tokenizer.eos_token_id
        vocab = self.tokenizer.get_vocab()
        self.strings = [""] * self.size
        for text, token in vocab.items():
            self.strings[token] = text
        self.special = {token for token, added in self.tokenizer.added_tokens_decoder.items() if added.special}
        decode = byte_decoder()
        self.bytes = [text.encode() if token in self.special else bytes(decode[ch] for ch in text)
                      for token, text in enumerate(self.strings)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


# -- the engines, each behind the same small adapter ---------------------------------------------
class Llguidance:
    name = "llguidance"
    package = "llguidance"

    def __init__(self, vocab: Vocab):
        import llguidance
        import llguidance.numpy

        self.lib, self.np = llguidance, llguidance.numpy
        start = time.perf_counter()
        self.tokenizer = llguidance.LLTokenizer(vocab.json_text, n_vocab=vocab.size, eos_token=vocab.eos)
        self.setup_s = time.perf_counter() - start
        self.executor = llguidance.LLExecutor(num_threads=2)
        self.options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}

    def _matcher(self, grammar: str):
        error = self.lib.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def schema(self, schema):
        return self._matcher(self.lib.LLMatcher.grammar_from_json_schema(schema, defaults=self.options))

    def json_mode(self):
        return self.schema({})

    def regex(self, pattern):
        return self._matcher(self.lib.LLMatcher.grammar_from_regex(pattern))

    def grammar(self):
        return self._matcher(self.lib.LLMatcher.grammar_from_lark(LARK))

    def mask(self, matcher, out):
        matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def consume(self, matcher, tokens) -> int:
        count = matcher.try_consume_tokens(list(tokens))
        return count

    def rollback(self, matcher, n):
        matcher.rollback(n)

    def forced(self, matcher):
        return matcher.compute_ff_tokens()

    def accepting(self, matcher):
        return matcher.is_accepting()

    def batched(self, matchers_drafts, out):
        """Masks of several sequences and every position of their drafts in one call."""
        rows = []
        index = 0
        for matcher, draft in matchers_drafts:
            rows.append((matcher, index, list(draft)))
            index += len(draft) + 1
        self.np.fill_next_token_bitmask_par_with_draft_tokens(self.executor, rows, out)


class Xgrammar:
    name = "xgrammar"
    package = "xgrammar"

    def __init__(self, vocab: Vocab):
        import torch
        import xgrammar

        self.lib, self.torch = xgrammar, torch
        start = time.perf_counter()
        metadata = xgrammar.TokenizerInfo._detect_metadata_from_hf(vocab.json_text)
        self.info = xgrammar.TokenizerInfo(vocab.strings, metadata["vocab_type"], vocab_size=vocab.size,
                                           stop_token_ids=[vocab.eos], add_prefix_space=metadata["add_prefix_space"])
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self.setup_s = time.perf_counter() - start
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def _matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def schema(self, schema):
        return self._matcher(self.compiler.compile_json_schema(dumps(schema), any_whitespace=False,
                                                               separators=COMPACT, strict_mode=True))

    def json_mode(self):
        return self._matcher(self.compiler.compile_builtin_json_grammar())

    def regex(self, pattern):
        return self._matcher(self.compiler.compile_regex(pattern))

    def grammar(self):
        return self._matcher(self.compiler.compile_grammar(EBNF))

    def mask(self, matcher, out):
        matcher.fill_next_token_bitmask(self.torch.from_numpy(out.reshape(1, -1)), 0)

    def consume(self, matcher, tokens) -> int:
        for count, token in enumerate(tokens):
            if not matcher.accept_token(int(token)):
                return count
        return len(tokens)

    def rollback(self, matcher, n):
        matcher.rollback(n)

    def forced(self, matcher):
        return matcher.find_jump_forward_tokens()

    def accepting(self, matcher):
        return matcher.is_completed()

    def batched(self, matchers_drafts, out):
        """xgrammar batches across matchers (one mask each, ``BatchGrammarMatcher``); the
        positions of a chain draft are walked per matcher (``traverse_draft_tree`` does so for
        trees): fill, accept, fill, ..., then roll back."""
        one_by_one(self, matchers_drafts, out)


class OutlinesCore:
    name = "outlines-core"
    package = "outlines_core"

    def __init__(self, vocab: Vocab):
        import outlines_core

        self.lib = outlines_core
        start = time.perf_counter()
        table: dict[bytes, list[int]] = {}
        for token, raw in enumerate(vocab.bytes):
            if token not in vocab.special:  # outlines-core keeps EOS apart and knows no other special tokens
                table.setdefault(raw, []).append(token)
        self.vocabulary = outlines_core.Vocabulary(vocab.eos, table)
        self.setup_s = time.perf_counter() - start

    def _matcher(self, regex):
        return self.lib.Guide(self.lib.Index(regex, self.vocabulary), max_rollback=64)

    def schema(self, schema):
        return self._matcher(self.lib.json_schema.build_regex_from_schema(dumps(schema), whitespace_pattern=""))

    def json_mode(self):
        # outlines-core has no grammar for arbitrary JSON (it is not regular): a schema of {} is
        # expanded to a depth-limited regex.
        return self.schema({})

    def regex(self, pattern):
        return self._matcher(pattern)

    def grammar(self):
        raise NotImplementedError("outlines-core compiles regular expressions only (no context-free grammar)")

    def mask(self, matcher, out):
        matcher.write_mask_into(out.ctypes.data, out.size, 4)

    def consume(self, matcher, tokens) -> int:
        for count, token in enumerate(tokens):
            try:
                matcher.advance(int(token), return_tokens=False)
            except ValueError:
                return count
        return len(tokens)

    def rollback(self, matcher, n):
        matcher.rollback_state(n)

    def forced(self, matcher):
        return None  # no fast-forward API (a state whose allowed list has one token can be read off)

    def accepting(self, matcher):
        return matcher.is_finished()

    def batched(self, matchers_drafts, out):
        one_by_one(self, matchers_drafts, out)  # no batched API


def one_by_one(engine, matchers_drafts, out) -> None:
    """The masks of each sequence's current state and of every position of its draft, one
    mask at a time: fill, advance one token, fill, ..., then roll the draft back."""
    index = 0
    for matcher, draft in matchers_drafts:
        engine.mask(matcher, out[index])
        accepted = 0
        for token in draft:
            if engine.consume(matcher, [token]) != 1:
                break
            accepted += 1
            engine.mask(matcher, out[index + accepted])
        if accepted:
            engine.rollback(matcher, accepted)
        index += len(draft) + 1


ENGINES = (Llguidance, Xgrammar, OutlinesCore)


# -- measurements ----------------------------------------------------------------------------------
def words(size):
    return (size + 31) // 32


def bit(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def accepts(engine, vocab: Vocab, matcher, text: str) -> bool:
    """Whether ``matcher`` takes the whole of ``text`` (as the tokenizer encodes it) and then
    allows the end (EOS in the mask, or an accepting state)."""
    tokens = vocab.encode(text)
    if engine.consume(matcher, tokens) != len(tokens):
        return False
    out = np.zeros(words(vocab.size), dtype=np.int32)
    engine.mask(matcher, out)
    return bit(out, vocab.eos) or engine.accepting(matcher)


def measure_walk(engine, vocab: Vocab, make, instance_text: str) -> dict:
    """Compile to the first mask, then walk the instance's tokens: a mask per position, and at
    every position a 4-token draft advanced and rolled back, its mask compared bitwise."""
    out = np.zeros(words(vocab.size), dtype=np.int32)
    start = time.perf_counter()
    matcher = make()
    engine.mask(matcher, out)
    compile_s = time.perf_counter() - start
    forced_at_start = engine.forced(matcher)
    tokens = vocab.encode(instance_text)
    mask_s, roundtrip_s, forced_s, mismatches, refused = [], [], [], 0, None
    forced_hits = 0  # instance tokens the grammar forced (a free draft under speculation)
    again = np.zeros_like(out)
    for position, token in enumerate(tokens):
        _, seconds = timed(lambda: engine.mask(matcher, out))
        mask_s.append(seconds)
        forced, seconds = timed(lambda: engine.forced(matcher))
        forced_s.append(seconds)
        forced_hits += int(bool(forced) and forced[0] == token)
        if not bit(out, token):
            refused = position
            break
        draft = tokens[position:position + DRAFT]
        start = time.perf_counter()
        taken = engine.consume(matcher, draft)
        engine.rollback(matcher, taken)
        roundtrip_s.append(time.perf_counter() - start)
        engine.mask(matcher, again)
        mismatches += int(not np.array_equal(out, again))
        if engine.consume(matcher, [token]) != 1:
            refused = position
            break
    engine.mask(matcher, out)
    return {
        "compile_to_first_mask_ms": 1e3 * compile_s,
        "tokens": len(tokens),
        "mask_us_mean": 1e6 * statistics.fmean(mask_s),
        "mask_us_p50": 1e6 * statistics.median(mask_s),
        "mask_us_max": 1e6 * max(mask_s),
        "draft_advance_rollback_us_mean": 1e6 * statistics.fmean(roundtrip_s) if roundtrip_s else None,
        "rollback_mask_mismatches": mismatches,
        "instance_refused_at": refused,
        "eos_allowed_at_end": refused is None and (bit(out, vocab.eos) or engine.accepting(matcher)),
        "forced_us_mean": None if forced_at_start is None else 1e6 * statistics.fmean(forced_s),
        "forced_share": None if forced_at_start is None else forced_hits / len(tokens),
        "forced_at_start": None if forced_at_start is None else vocab.tokenizer.decode(forced_at_start),
        "forced_tokens_at_start": None if forced_at_start is None else len(forced_at_start),
    }


def measure_batched(engine, vocab: Vocab, schema, instance_text: str, sequences: int = 4) -> dict:
    """4 sequences, each at a different point of the instance with a 4-token draft: 20 masks.
    Compared bitwise with the masks computed one by one."""
    tokens = vocab.encode(instance_text)
    matchers_drafts = []
    for s in range(sequences):
        matcher = engine.schema(schema)
        cut = (s * len(tokens)) // (sequences + 1)
        engine.consume(matcher, tokens[:cut])
        matchers_drafts.append((matcher, tokens[cut:cut + DRAFT]))
    rows = sum(len(draft) + 1 for _, draft in matchers_drafts)
    out = np.zeros((rows, words(vocab.size)), dtype=np.int32)
    engine.batched(matchers_drafts, out)  # warm
    times = []
    for _ in range(5):
        out[:] = 0
        _, seconds = timed(lambda: engine.batched(matchers_drafts, out))
        times.append(seconds)
    reference = np.zeros_like(out)
    one_by_one(engine, matchers_drafts, reference)
    return {"rows": rows, "batched_ms": 1e3 * min(times), "per_row_us": 1e6 * min(times) / rows,
            "equals_one_by_one": bool(np.array_equal(out, reference))}


def apply_costs(vocab_size: int, repeats: int = 200) -> dict:
    """The cost of turning a mask into −inf logits, per representation (engine-independent):
    a packed int32 bitmask [ceil(V/32)] unpacked with numpy then ``masked_fill_``; a bool [V]
    straight into ``masked_fill_``; llguidance's byte-per-token bias added. Best of ``repeats``."""
    import torch

    rng = np.random.default_rng(0)
    allowed = rng.random(vocab_size) < 0.1
    packed = np.packbits(np.concatenate([allowed, np.zeros(-vocab_size % 32, bool)]), bitorder="little").view(np.int32)
    logits = torch.randn(vocab_size)
    boolean = torch.from_numpy(allowed)

    def from_packed():
        bits = np.unpackbits(packed.view(np.uint8), count=vocab_size, bitorder="little").view(bool)
        return logits.clone().masked_fill_(~torch.from_numpy(bits), float("-inf"))

    def from_bool():
        return logits.clone().masked_fill_(~boolean, float("-inf"))

    def clone_only():
        return logits.clone()

    assert torch.equal(from_packed(), from_bool())
    costs = {}
    for name, fn in (("logits.clone() alone", clone_only), ("bool [V] → masked_fill_", from_bool),
                     ("packed int32 [V/32] → numpy unpackbits → masked_fill_", from_packed)):
        best = min(timed(fn)[1] for _ in range(repeats))
        costs[name] = 1e6 * best
    return costs


def coverage(engine, vocab: Vocab) -> dict:
    results = {}
    for keyword, schema, good, bad in COVERAGE:
        try:
            ok = accepts(engine, vocab, engine.schema(schema), dumps(good))
            refused = not accepts(engine, vocab, engine.schema(schema), dumps(bad))
        except Exception as error:  # each engine raises its own types for an unsupported schema
            results[keyword] = f"refused: {str(error).splitlines()[0][:160]}"
            continue
        results[keyword] = "wrong (valid refused)" if not ok else "enforced" if refused else "ignored"
    return results


def grammar_support(engine, vocab: Vocab) -> dict:
    found = {}
    for kind, make, good, bad in (("regex", lambda: engine.regex(REGEX), REGEX_OK, REGEX_BAD),
                                  ("grammar", engine.grammar, GRAMMAR_OK, GRAMMAR_BAD)):
        try:
            ok = accepts(engine, vocab, make(), good)
            refused = not accepts(engine, vocab, make(), bad)
            found[kind] = "enforced" if ok and refused else f"wrong (good {ok}, bad refused {refused})"
        except Exception as error:
            found[kind] = f"unsupported: {str(error).splitlines()[0][:160]}"
    return found


def install_facts(package: str) -> dict:
    """Version, run-time requirements and installed megabytes of the package and of each
    requirement that the project's own environment does not already hold (torch, transformers,
    numpy and pydantic are there)."""
    dist = importlib.metadata.distribution(package)
    requires = [r for r in (dist.requires or []) if "extra ==" not in r]
    own = {"torch", "transformers", "numpy", "pydantic", "typing-extensions"}
    extra = {}
    for requirement in requires:
        name = requirement.split(";")[0].split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip()
        if name.lower() in own:
            continue
        try:
            other = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        extra[f"{name} {other.version}"] = round(sum(f.size or 0 for f in other.files) / 1e6, 1)
    return {"version": dist.version, "requires": requires,
            "installed_mb": round(sum(f.size or 0 for f in dist.files) / 1e6, 1), "pulls_in_mb": extra}


def run_engine(cls, vocab: Vocab) -> dict:
    try:
        facts = install_facts(cls.package)
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    engine = cls(vocab)
    report = {"installed": True, **facts, "tokenizer_setup_s": engine.setup_s, "schemas": {}}
    for shape, (schema, instance) in SCHEMAS.items():
        print(f"  {cls.name}: {shape}", file=sys.stderr, flush=True)
        report["schemas"][shape] = measure_walk(engine, vocab, lambda: engine.schema(schema), dumps(instance))
    print(f"  {cls.name}: json mode", file=sys.stderr, flush=True)
    report["schemas"][JSON_MODE[0]] = measure_walk(engine, vocab, engine.json_mode, dumps(JSON_MODE[1]))
    report["batched"] = measure_batched(engine, vocab, ARTICLE, dumps(SCHEMAS["nested arrays"][1]))
    print(f"  {cls.name}: coverage", file=sys.stderr, flush=True)
    report["coverage"] = coverage(engine, vocab)
    report["grammars"] = grammar_support(engine, vocab)
    return report


def markdown(results: dict, vocab_size: int) -> str:
    names = [name for name in results["engines"] if results["engines"][name].get("installed")]
    lines = [f"# Grammar engines on the default model's vocabulary ({vocab_size:,} tokens)", "",
             f"Command: `{results['command']}`", f"CPU: {results['cpu']}; under the exclusive lock.", "",
             "## Install", "", "| engine | version | own MB | pulls in (MB) | tokenizer set-up s |", "|---|---|---|---|---|"]
    for name in names:
        r = results["engines"][name]
        pulls = ", ".join(f"{k} ({v})" for k, v in r["pulls_in_mb"].items()) or "nothing new"
        lines.append(f"| {name} | {r['version']} | {r['installed_mb']} | {pulls} | {r['tokenizer_setup_s']:.2f} |")
    lines += ["", "## Per schema: compile to first mask (ms) · mask per token mean / max (µs) · 4-token draft "
              "advance + rollback (µs) · rollback mismatches · forced tokens at the start", ""]
    header = "| schema | " + " | ".join(names) + " |"
    lines += [header, "|---" * (len(names) + 1) + "|"]
    for shape in results["engines"][names[0]]["schemas"]:
        cells = []
        for name in names:
            s = results["engines"][name]["schemas"][shape]
            ok = "" if s["instance_refused_at"] is None and s["eos_allowed_at_end"] else \
                f" **instance refused at token {s['instance_refused_at']}**"
            forced = "—" if s["forced_tokens_at_start"] is None else f"{s['forced_tokens_at_start']} `{s['forced_at_start']}`"
            roundtrip = "—" if s["draft_advance_rollback_us_mean"] is None else f"{s['draft_advance_rollback_us_mean']:.0f}"
            cells.append(f"{s['compile_to_first_mask_ms']:.1f} · {s['mask_us_mean']:.0f} / {s['mask_us_max']:.0f} · "
                         f"{roundtrip} · {s['rollback_mask_mismatches']} · {forced}{ok}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    lines += ["", "## Forced tokens: share of the instance's tokens the grammar forces (free drafts) · µs per query", "",
              header, "|---" * (len(names) + 1) + "|"]
    for shape in results["engines"][names[0]]["schemas"]:
        cells = []
        for name in names:
            s = results["engines"][name]["schemas"][shape]
            cells.append("no API" if s["forced_share"] is None else
                         f"{100 * s['forced_share']:.0f}% of {s['tokens']} · {s['forced_us_mean']:.0f}")
        lines.append(f"| {shape} | " + " | ".join(cells) + " |")
    a = results["apply"]
    lines += ["", "## Applying a mask to one logits row [V] float32 (−inf where forbidden), µs", "",
              "| from | µs |", "|---|---|"] + [f"| {k} | {v:.1f} |" for k, v in a.items()]
    lines += ["", "## Batched: 4 sequences × (1 + 4-token draft) = 20 masks", "",
              "| engine | ms for all | µs per row | equals one-by-one |", "|---|---|---|---|"]
    for name in names:
        b = results["engines"][name]["batched"]
        lines.append(f"| {name} | {b['batched_ms']:.2f} | {b['per_row_us']:.0f} | {b['equals_one_by_one']} |")
    lines += ["", "## JSON Schema coverage (valid instance accepted and invalid refused = enforced)", "",
              header.replace("schema", "keyword"), "|---" * (len(names) + 1) + "|"]
    for keyword, *_ in COVERAGE:
        lines.append(f"| {keyword} | " + " | ".join(results["engines"][n]["coverage"][keyword].replace("|", "\\|")
                                                  for n in names) + " |")
    for kind in ("regex", "grammar"):
        lines.append(f"| **{kind}** | " + " | ".join(results["engines"][n]["grammars"][kind].replace("|", "\\|")
                                                    for n in names) + " |")
    return "\n".join(lines) + "\n"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    vocab = Vocab()
    results = {"command": "PYTHONPATH=. flock -x /tmp/tierspec-cpu.lock /tmp/grammar-venv/bin/python "
                          "benchmarks/grammar_bakeoff.py", "cpu": cpu_name(), "vocab_size": vocab.size,
               "python": sys.version.split()[0], "engines": {}}
    results["apply"] = apply_costs(vocab.size)
    for cls in ENGINES:
        print(f"{cls.name} ...", file=sys.stderr, flush=True)
        results["engines"][cls.name] = run_engine(cls, vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in (("bakeoff.json", json.dumps(results, indent=2)), ("bakeoff.md", markdown(results, vocab.size))):
        staging = args.out / f".{name}.tmp"
        staging.write_text(text)
        staging.replace(args.out / name)
    print(markdown(results, vocab.size))


if __name__ == "__main__":
    main()
