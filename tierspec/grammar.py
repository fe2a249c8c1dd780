"""Grammars for structured output: a JSON schema, JSON mode, a regex or a Lark grammar compiled
once per request against the model's tokenizer, and a per-sequence state that says which tokens
may come next (docs/DESIGN.md §12, docs/structured.md).

A grammar is a stateful sampling modifier. At a verified position t the target's logits are
masked to the tokens the grammar allows after the committed tokens and the drafts before t
(−∞ elsewhere): the rule then verifies against exactly what constrained ``ar`` samples from, so
every lossless method stays exact. The state advances along a draft and rolls back with a
rejection; a drafted token the grammar refuses is cut before the pass (``valid_prefix``); where
the grammar forces tokens (``forced``: keys, braces, quotes of a schema) they are free drafts
that the masked target accepts with probability 1.

The engine is llguidance (pinned in pyproject.toml), chosen by ``benchmarks/grammar_bakeoff.py``
on the default model's 49,152-token vocabulary (results/grammar_bakeoff/bakeoff.md, one
exclusive run on the 2-core Xeon):

- it refuses what it cannot enforce, by name (``Unimplemented keys: ["uniqueItems"]``): of 28
  JSON Schema keyword probes it enforced 23 and refused 5 (uniqueItems, contains, not,
  if/then/else, dependentRequired). xgrammar 0.2.9 silently ignored 6 (the output would then
  fail validation) and refused a valid patternProperties instance; outlines-core 0.2.14 ignored
  the number and count bounds and refused a valid exclusiveMinimum instance;
- schema compile to the first mask 0.7-2.6 ms (xgrammar 2-12 ms, outlines-core 29-1,845 ms);
- mask per token 11-25 µs mean, ≤ 111 µs worst (xgrammar 3-7 µs, outlines-core 3-64 µs): all
  far under a 16 ms pass (0.1%);
- a 4-token draft advanced and rolled back in 6-17 µs, masks bitwise equal after it; forced
  tokens in 4-6 µs (24-59% of a schema's tokens are forced); the masks of several sequences and
  all their draft positions in one parallel call (``fill_next_token_bitmask_par_with_draft_tokens``);
- Lark grammars with embedded JSON schemas (the tool-call format) and regexes;
- an 8 MB wheel with no dependencies (xgrammar needs torch and pulls triton, 1 GB installed).

Token masks are bool [V] (``allowed``); they are applied with ``torch.where`` (``mask_logits``):
measured at 22 µs for one 49,152-wide row, against 35 µs for ``masked_fill_`` and 43 µs for
unpacking the packed bitmask in torch (numpy's ``unpackbits`` of the engine's packed words costs
5 µs and is what ``allowed`` does).

An end-of-sequence token is never passed to llguidance: the state takes it itself when the
grammar is accepting (llguidance 1.9.1 computes wrong masks after an end token is consumed and
rolled back at a finished grammar; tested here), so rolling back across the end is exact too.
"""

from __future__ import annotations

import json
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch

from .errors import TierspecError

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]

#: How generated JSON is laid out: Python's ``json.dumps`` separators and no other whitespace
#: (the layout the model has seen most, and the one that forces the most tokens). Given as
#: llguidance's overrides, so a schema's own ``x-guidance`` options cannot loosen them; in
#: particular ``lenient`` (ignore unimplemented keywords) and ``coerce_one_of`` (enforce a ``oneOf``
#: whose branches overlap as ``anyOf``: text valid under two branches, which the schema forbids)
#: stay off: a schema is enforced whole or refused.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
                "coerce_one_of": False}


class GrammarError(TierspecError):
    """A schema or grammar that cannot be compiled or enforced; the message names the fault
    (the server answers it with a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a generation is constrained to. ``source``: the JSON schema as JSON text (property
    order kept: it is the order the keys are generated in), the regex, or the Lark grammar;
    empty for ``json_object`` (any JSON object)."""

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str) -> GrammarSpec:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as error:
                raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        if schema is False:
            raise GrammarError("the JSON schema false admits no value: no text can satisfy it")
        if schema is True:  # any JSON value: the engine takes options only on an object schema
            schema = {}
        return cls("json_schema", json.dumps(schema, ensure_ascii=False))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("give a non-empty regular expression")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("give a non-empty Lark grammar")
        return cls("lark", grammar)

    def engine_grammar(self) -> str:
        """The grammar in llguidance's serialised form."""
        from llguidance import LLMatcher

        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        raise GrammarError(f"unknown grammar kind {self.kind!r}")


# -- the tokenizer, as the engine sees it (built once per tokenizer: 0.25 s for 49,152 tokens) ----------
_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VOCABULARIES_LOCK = threading.Lock()


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizer.json`` text of ``tokenizer`` (tierspec's own ``FastTokenizer`` or a
    transformers fast tokenizer), padding and truncation off."""
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend", None) or getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise GrammarError("structured output needs a tokenizer with a tokenizer.json (a fast tokenizer); "
                           f"this model's is {type(tokenizer).__name__}")
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


#: Up to this many words of special tokens are read one by one (``SpecialTokens.allowed_in``).
FEW_SPECIAL_WORDS = 8


@dataclass(frozen=True)
class SpecialTokens:
    """A vocabulary's special tokens (the end tokens among them) as packed-mask words and bits, to find
    them in a mask with one vectorised read. llguidance lets a special token into a mask where its
    spelled-out text fits the grammar (the regex ``<\\|im_end\\|>``; an end token where the text is not
    complete) and then refuses to take it: a mask must allow only what the state takes
    (``GrammarState.bitmask``)."""

    ids: tuple[int, ...]
    words: np.ndarray  # int64 [w]: the words that hold special tokens
    bits: np.ndarray  # uint32 [w]: their special tokens' bits
    names: dict[int, str]  # each one's text ("<|im_start|>")

    @classmethod
    def of(cls, vocabulary, vocab_size: int) -> "SpecialTokens":
        ids = tuple(token for token in range(vocab_size) if vocabulary.is_special_token(token))
        by_word: dict[int, int] = {}
        for token in ids:
            by_word[token // 32] = by_word.get(token // 32, 0) | (1 << (token % 32))
        names = {token: vocabulary.decode_bytes([token]).decode("utf-8", "replace") for token in ids}
        return cls(ids, np.array(sorted(by_word), dtype=np.int64),
                   np.array([by_word[word] for word in sorted(by_word)], dtype=np.uint32), names)

    def __post_init__(self) -> None:
        # (word, bits) pairs as Python ints: most vocabularies keep their special tokens in a few words
        # (SmolLM2's 17 in word 0), read faster one by one than by numpy's fancy indexing (~5 us a mask)
        object.__setattr__(self, "pairs", tuple(zip(self.words.tolist(), self.bits.tolist())))

    def allowed_in(self, words: np.ndarray) -> list[int]:
        """The special tokens the packed mask ``words`` (uint32 view [ceil(V/32)]) allows: the words
        that hold any read at once, then only their set bits (an end token where the text is
        complete: almost always one bit, or none)."""
        if len(self.pairs) <= FEW_SPECIAL_WORDS:
            hit = [(word, int(words[word]) & bits) for word, bits in self.pairs]
        else:
            hits = words[self.words] & self.bits
            hit = [(int(self.words[i]), int(hits[i])) for i in np.flatnonzero(hits)]
        found = []
        for word, bits in hit:
            while bits:
                low = bits & -bits
                found.append(32 * word + low.bit_length() - 1)
                bits ^= low
        return found


def special_tokens(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> SpecialTokens:
    """``SpecialTokens`` of ``engine_tokenizer``'s vocabulary, made once per tokenizer (49,152 questions)."""
    vocabulary = engine_tokenizer(tokenizer, vocab_size, eos_token_ids)
    with _VOCABULARIES_LOCK:
        per_tokenizer = _VOCABULARIES.setdefault(tokenizer, {})
        key = ("special", vocab_size, tuple(sorted({int(token) for token in eos_token_ids})))
        if key not in per_tokenizer:
            per_tokenizer[key] = SpecialTokens.of(vocabulary, vocab_size)
        return per_tokenizer[key]


def engine_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's tokenizer for (``tokenizer``, the model's output width ``vocab_size``, its end
    tokens), cached per tokenizer object."""
    from llguidance import LLTokenizer

    eos = tuple(sorted({int(token) for token in eos_token_ids}))
    if not eos:
        raise GrammarError("structured output needs the model's end-of-sequence token (none is known)")
    if any(not 0 <= token < vocab_size for token in eos):
        raise GrammarError(f"end-of-sequence ids {list(eos)} are outside the vocabulary of {vocab_size}")
    with _VOCABULARIES_LOCK:
        per_tokenizer = _VOCABULARIES.setdefault(tokenizer, {})
        key = (vocab_size, eos)
        if key not in per_tokenizer:
            try:
                per_tokenizer[key] = LLTokenizer(tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=list(eos))
            except ValueError as error:
                raise GrammarError(f"the grammar engine cannot read this tokenizer: {error}") from None
        return per_tokenizer[key]


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")
MESSAGE_LIMIT = 400  # characters of an engine's message kept in an error (one line)
KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON grammar", "regex": "regular expression",
              "lark": "Lark grammar"}


def _compile_error(spec: GrammarSpec, message: str) -> GrammarError:
    """llguidance's message as a one-line error naming what is wrong (its detail kept: a regex's
    parse error is on the lines after the first)."""
    message = " ".join(message.split()) or "unknown error"
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 1] + "…"
    # its advice to switch an option on that tierspec keeps off (``JSON_OPTIONS``)
    message = re.sub(r"\s*Enable 'coerce_one_of' option[^.]*\.?", "", message)
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        keys = ", ".join(key.strip().strip('"') for key in unimplemented.group(1).split(","))
        return GrammarError(f"the JSON schema uses keywords tierspec cannot enforce: {keys} "
                            "(leave them out, or check them after generation)")
    return GrammarError(f"invalid {KIND_NAMES[spec.kind]}: {message}")


def _pointer_part(key) -> str:
    """A JSON pointer's reference token for ``key`` (RFC 6901: ``~`` as ``~0``, ``/`` as ``~1``)."""
    return "/" + str(key).replace("~", "~0").replace("/", "~1")


def _schema_patterns(node, pointer: str = "") -> list[tuple[str, str]]:
    """(JSON pointer, regex) of every ``pattern`` and ``patternProperties`` key in a JSON schema."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            here = pointer + _pointer_part(key)
            if key == "pattern" and isinstance(value, str):
                found.append((here, value))
            elif key == "patternProperties" and isinstance(value, dict):
                for regex, sub in value.items():
                    found.append((here + _pointer_part(regex), regex))
                    found += _schema_patterns(sub, here + _pointer_part(regex))
            elif key in ("default", "const", "enum", "examples"):  # data, not schemas: a "pattern" key there is a value
                continue
            elif key in ("properties", "$defs", "definitions", "dependentSchemas") and isinstance(value, dict):
                for name, sub in value.items():  # a property named "pattern" is a schema, not a regex
                    found += _schema_patterns(sub, here + _pointer_part(name))
            else:
                found += _schema_patterns(value, here)
    elif isinstance(node, list):
        for index, item in enumerate(node):
            found += _schema_patterns(item, pointer + _pointer_part(index))
    return found


def _where_in_schema(spec: GrammarSpec, message: str, vocabulary) -> str:
    """A schema's regex error with the place of the pattern that caused it: llguidance names the
    regex's fault, not where in the schema it sits (a schema may hold dozens of patterns)."""
    from llguidance import LLMatcher

    if spec.kind != "json_schema" or "regex" not in message.lower():
        return message
    for pointer, regex in _schema_patterns(json.loads(spec.source)):
        problem = LLMatcher.validate_grammar(GrammarSpec("regex", regex).engine_grammar(), vocabulary)
        if problem and not problem.startswith("WARNING"):
            return f"the pattern at {pointer} ({json.dumps(regex, ensure_ascii=False)}): {message}"
    return message


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled against one tokenizer: ``new_state()`` starts a sequence (a copy of
    the compiled initial state, no recompile)."""

    spec: GrammarSpec
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    _initial: object  # llguidance.LLMatcher at the start, never advanced
    special: SpecialTokens

    def new_state(self) -> GrammarState:
        return GrammarState(self, self._initial.deep_copy())

    def start(self) -> GrammarState:
        """A new state: the decode loop's ``constraints.Constraint``."""
        return self.new_state()


def compile_grammar(spec: GrammarSpec, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> CompiledGrammar:
    """Compile ``spec`` for a model with ``tokenizer``, ``vocab_size`` output logits and end
    tokens ``eos_token_ids``; a ``GrammarError`` naming the fault when it cannot be enforced."""
    from llguidance import LLMatcher

    vocabulary = engine_tokenizer(tokenizer, vocab_size, eos_token_ids)
    try:
        grammar = spec.engine_grammar()
    except ValueError as error:  # a schema that is not a JSON object, say
        raise _compile_error(spec, str(error)) from None
    problem = LLMatcher.validate_grammar(grammar, vocabulary)
    if problem and not problem.startswith("WARNING"):
        raise _compile_error(spec, _where_in_schema(spec, problem, vocabulary))
    matcher = LLMatcher(vocabulary, grammar, log_level=0)
    if matcher.is_error():
        raise _compile_error(spec, _where_in_schema(spec, matcher.get_error(), vocabulary))
    compiled = CompiledGrammar(spec, vocab_size, tuple(vocabulary.eos_tokens), matcher,
                               special_tokens(tokenizer, vocab_size, eos_token_ids))
    # A grammar that compiles may still match nothing ([^\s\S], a Lark intersection of disjoint
    # terminals): the engine then fails at the first token, mid-generation. Asked for the first
    # token's mask now, it is refused as the request's fault.
    try:
        nothing = not compiled.new_state().allowed().any()
    except GrammarError:
        nothing = True
    if nothing:
        raise GrammarError(f"the {KIND_NAMES[spec.kind]} matches no text: nothing could be generated under it")
    return compiled


def _words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_masks(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """Packed int32 bitmasks [r, ceil(V/32)] (bit j of word i = token 32i + j) → bool [r, V]."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits.view(bool))


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [r, V] with −∞ where ``allowed`` [r, V] (bool) is False; a new tensor."""
    return torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=logits.dtype))


class GrammarState:
    """The grammar's state along one sequence: the tokens taken since the start (``position``
    of them, an end token included) decide what may come next.

    Invariants (tests/pure/test_grammar.py): ``advance(tokens)`` reaches the state that taking
    the tokens one by one reaches; ``rollback(n)`` returns to the state ``n`` tokens before, so
    its masks, forced tokens and acceptance are bitwise those seen there before. A token the
    grammar refuses is never taken: ``advance`` stops before it and the state stays usable.
    """

    def __init__(self, compiled: CompiledGrammar, matcher):
        self.compiled = compiled
        self._matcher = matcher
        self._taken = 0  # tokens llguidance holds (an end token is not passed to it)
        self._ended = False  # an end token was taken: nothing may follow
        self._eos = frozenset(compiled.eos_token_ids)

    # -- reading the state ------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Tokens taken since the start."""
        return self._taken + int(self._ended)

    def accepting(self) -> bool:
        """Whether the text so far is complete: the end may come now."""
        return self._ended or self._matcher.is_accepting()

    def stopped(self) -> bool:
        """Whether nothing but the end may follow (or the end was taken)."""
        return self._ended or self._matcher.is_stopped()

    def finished(self) -> bool:
        """Whether the end token was taken: nothing more may be generated (the decode loop's
        ``ConstraintState.finished``). A ``stopped`` grammar is not finished: its end token is
        still to come (forced, a free draft where the model has one end token), so every method's
        text ends the same way, with it."""
        return self._ended

    @property
    def ended(self) -> bool:
        return self._ended

    def _check(self) -> None:
        if self._matcher.is_error():  # never expected: the state only takes tokens the engine allowed
            raise GrammarError(f"the grammar engine failed: {self._matcher.get_error().splitlines()[0]}")

    def bitmask(self, out: np.ndarray) -> None:
        """Write the packed mask of the next token into ``out`` (int32 [ceil(V/32)])."""
        if out.dtype != np.int32 or out.shape != (_words(self.compiled.vocab_size),) or not out.flags.c_contiguous:
            raise ValueError(f"the bitmask must be a contiguous int32 array of {_words(self.compiled.vocab_size)} words")
        if self._ended:
            out[:] = 0
            _set_bits(out, self._eos)  # after the end only the end again: a defined row, never used
            return
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()
        self._settle_special(out)

    def dead_end(self) -> str | None:
        """Why no token may come next, where none may and the text is not ended (None: one may):
        the special tokens the grammar's text needs next, which are not text (``SpecialTokens``)."""
        if self._ended:
            return None
        words = np.zeros(_words(self.compiled.vocab_size), dtype=np.int32)
        self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        self._check()
        needed = self.compiled.special.allowed_in(words.view(np.uint32))
        self._settle_special(words, needed)
        if words.any():
            return None
        named = ", ".join(f"{self.compiled.special.names[token]!r} (id {token})" for token in needed) or "none"
        if any(token in self._eos for token in needed):
            return (f"the constraint allows no token after {self._taken} generated tokens but the end token "
                    f"({named}) inside its text: the end token ends the generation, so a grammar ends where its "
                    "text ends, without naming it")
        return (f"the constraint allows no token after {self._taken} generated tokens: its text goes on only with "
                f"the text of special tokens ({named}), which the model writes as those tokens, not as text; "
                "leave special tokens' text out of the constraint")

    def _settle_special(self, out: np.ndarray, allowed: list[int] | None = None) -> None:
        """Clear from this state's mask ``out`` the special tokens it would not take: an end token
        where the text is not complete, another special token the engine refuses (``SpecialTokens``).
        Only the special tokens the mask allows are asked about (``allowed``, when the caller found
        them): almost always none, or the end token where the text is complete."""
        words = out.view(np.uint32)
        for token in self.compiled.special.allowed_in(words) if allowed is None else allowed:
            if token in self._eos:
                keep = self._matcher.is_accepting()
            else:
                keep = self._matcher.validate_tokens([token]) == 1
            if not keep:
                words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)

    def allowed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tokens that may come next: bool [V] (written into ``out`` when given)."""
        words = np.zeros(_words(self.compiled.vocab_size), dtype=np.int32)
        self.bitmask(words)
        mask = unpack_masks(words[None], self.compiled.vocab_size)[0]
        if out is None:
            return mask
        out.copy_(mask)
        return out

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar takes from here (the state is unchanged): a draft
        is cut there before the pass."""
        tokens = self._token_ids(tokens)
        if self._ended:
            return 0
        cut = next((i for i, token in enumerate(tokens) if token in self._eos), len(tokens))
        count = self._matcher.validate_tokens(tokens[:cut]) if cut else 0
        if count == cut < len(tokens):  # an end token after a valid prefix: taken if that text is complete
            if self._matcher.try_consume_tokens(tokens[:cut]) != cut:
                raise GrammarError("the grammar engine validated tokens it then refused")
            complete = self._matcher.is_accepting()
            self._rollback_engine(cut)
            count += int(complete)
        return count

    def _token_ids(self, tokens: Sequence[int]) -> list[int]:
        """``tokens`` as ints, each checked against the vocabulary (an id outside it would put
        the engine in an error state it never leaves)."""
        ids = [int(token) for token in tokens]
        bad = next((token for token in ids if not 0 <= token < self.compiled.vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0 .. {self.compiled.vocab_size - 1})")
        return ids

    # -- moving -------------------------------------------------------------------------------------------
    def advance(self, tokens: Sequence[int]) -> int:
        """Take ``tokens`` in order, stopping before the first the grammar refuses; the number
        taken. An end token is taken when the text before it is complete, and ends the state."""
        taken = 0
        for run, end_token in _runs(self._token_ids(tokens), self._eos):
            if self._ended:
                break
            if end_token is None:  # a run of ordinary tokens
                count = self._matcher.try_consume_tokens(run)
                self._check()
                self._taken += count
                taken += count
                if count < len(run):
                    break
            else:
                if not self._matcher.is_accepting():
                    break
                self._ended = True
                taken += 1
        return taken

    def rollback(self, count: int) -> None:
        """Undo the last ``count`` tokens taken."""
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= self.position:
            raise ValueError(f"cannot roll back {count!r} tokens: the state has taken {self.position}")
        if count and self._ended:
            self._ended = False
            count -= 1
        if count:
            self._rollback_engine(count)
            self._taken -= count

    def _rollback_engine(self, count: int) -> None:
        if count == 0:  # llguidance answers False to a rollback of nothing
            return
        if not self._matcher.rollback(count):
            self._check()
            raise GrammarError(f"the grammar engine could not roll back {count} tokens")

    def copy(self) -> GrammarState:
        """An independent state at the same point (for a tree path or another choice)."""
        other = GrammarState(self.compiled, self._matcher.deep_copy())
        other._taken, other._ended = self._taken, self._ended
        return other

    def forced(self, limit: int | None = None) -> list[int]:
        """The tokens the grammar forces from here (at most ``limit``): at each of them the
        grammar allows that token alone, so the masked target takes it with probability 1 —
        free drafts that are certain. The end token joins them when it is the only continuation
        left (and the model has one end token)."""
        if self._ended or limit == 0:
            return []
        tokens = self.fast_forward()
        if limit is not None:
            tokens = tokens[:limit]
        # The engine's tokens of the forced bytes need not be the only ones allowed (a space and
        # a quote may come as one token or two): keep the prefix the masks fix.
        tokens = tokens[:self._certain_prefix(tokens)]
        if (limit is None or len(tokens) < limit) and len(self._eos) == 1:
            taken = self._matcher.try_consume_tokens(tokens)
            if taken == len(tokens) and self._matcher.is_stopped():
                tokens.append(next(iter(self._eos)))
            if taken:
                self._rollback_engine(taken)
        return tokens

    def fast_forward(self) -> list[int]:
        """The engine's tokens for the bytes the grammar forces from here (llguidance's
        fast-forward tokens): free drafts the model almost always follows, but not each certain
        (``forced`` keeps those that are). The end token is never among them."""
        if self._ended:
            return []
        tokens = list(self._matcher.compute_ff_tokens())
        self._check()
        return tokens

    def _certain_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` are each the only token allowed at their step."""
        words = np.zeros(_words(self.compiled.vocab_size), dtype=np.int32)
        certain = 0
        for token in tokens:
            self._matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            self._settle_special(words)
            if np.count_nonzero(words) != 1 or int(words.view(np.uint32)[token // 32]) != 1 << (token % 32):
                break
            if self._matcher.try_consume_tokens([token]) != 1:
                break
            certain += 1
        if certain:
            self._rollback_engine(certain)
        return certain

    # -- masks along a draft or a tree --------------------------------------------------------------
    @staticmethod
    def chain_masks(states: Sequence[GrammarState], chains: Sequence[Sequence[int]], out: Sequence[torch.Tensor]) -> None:
        """``out[i]`` (bool [1 + len(chains[i]), V]) ← ``states[i]``'s masks along ``chains[i]``, every
        row of every sequence in one parallel call (``draft_masks``): the decode loop's batched
        ``constraints.ConstraintState.chain_masks``. Each chain must be one its state takes."""
        masks = draft_masks(states, chains)
        for i, (chain, rows) in enumerate(zip(chains, out)):
            if masks.valid[i] != len(chain):
                raise GrammarError(f"the grammar refuses token {chain[masks.valid[i]]} of a chain it was to take")
            rows.copy_(masks.rows(i))

    def tree_allowed(self, tokens: Sequence[int], parents: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The masks of a tree pass (``tree.TokenTree``'s tokens [m] and parents [m], −1 = the
        root, a parent before its children): (allowed bool [1+m, V], valid bool [m]). Row 0 is
        this state's mask; row 1+i the mask after node i's path, where the grammar allows the
        whole path (valid[i]); rows of invalid nodes are all False. The state is unchanged."""
        tokens, parents = [int(t) for t in tokens], [int(p) for p in parents]
        if len(tokens) != len(parents):
            raise ValueError(f"{len(tokens)} tokens but {len(parents)} parents")
        words = np.zeros((1 + len(tokens), _words(self.compiled.vocab_size)), dtype=np.int32)
        valid = [False] * len(tokens)
        self.bitmask(words[0])
        held: list[int] = []  # the nodes whose tokens the state holds now, root first
        paths: list[list[int]] = []  # each node's path: its ancestors and itself, root first
        for node, (token, parent) in enumerate(zip(tokens, parents)):
            if not -1 <= parent < node:
                raise ValueError(f"node {node}'s parent {parent} does not come before it")
            paths.append((paths[parent] if parent >= 0 else []) + [node])
            if parent >= 0 and not valid[parent]:
                continue
            # Move the state to the parent: back to the common ancestor, then down its path.
            target = paths[node][:-1]
            common = 0
            while common < min(len(held), len(target)) and held[common] == target[common]:
                common += 1
            self.rollback(len(held) - common)
            held = held[:common]
            for step in target[common:]:
                if self.advance([tokens[step]]) != 1:
                    raise GrammarError("the grammar engine refused a tree path it had allowed")
                held.append(step)
            if self.advance([token]) == 1:
                held.append(node)
                valid[node] = True
                self.bitmask(words[1 + node])
        self.rollback(len(held))
        return unpack_masks(words, self.compiled.vocab_size), torch.tensor(valid, dtype=torch.bool)


def _runs(tokens: list[int], eos: frozenset):
    """``tokens`` as runs: (list of ordinary tokens, None) and (None, end token) in order."""
    run: list[int] = []
    for token in tokens:
        if token in eos:
            if run:
                yield run, None
                run = []
            yield None, token
        else:
            run.append(token)
    if run:
        yield run, None


def _set_bits(words: np.ndarray, tokens) -> None:
    """Allow ``tokens`` in the packed mask ``words`` (int32 [ceil(V/32)])."""
    for token in tokens:
        words.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))


# -- the masks of many sequences' drafts together ------------------------------------------------------
_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            from llguidance import LLExecutor

            _EXECUTOR = LLExecutor(num_threads=max(1, min(os.cpu_count() or 1, 8)))
        return _EXECUTOR


@dataclass(frozen=True)
class DraftMasks:
    """The masks of a chain pass for several sequences: sequence i's rows are
    ``allowed[offsets[i] : offsets[i] + len(drafts[i]) + 1]`` — row j the mask after drafts[i][:j].
    ``valid[i]``: how many of its drafts the grammar takes; rows past ``valid[i]`` are all False
    (those drafts are cut before the pass)."""

    allowed: torch.Tensor  # bool [sum(k_i + 1), V]
    offsets: tuple[int, ...]
    valid: tuple[int, ...]

    def rows(self, sequence: int) -> torch.Tensor:
        """Sequence ``sequence``'s rows: bool [k + 1, V]."""
        end = self.offsets[sequence + 1] if sequence + 1 < len(self.offsets) else self.allowed.shape[0]
        return self.allowed[self.offsets[sequence]:end]


def draft_masks(states: Sequence[GrammarState], drafts: Sequence[Sequence[int]]) -> DraftMasks:
    """The masks of every position of every sequence's draft, computed together (llguidance's
    parallel executor); the states are unchanged. All states share a vocabulary size."""
    if len(states) != len(drafts):
        raise ValueError(f"{len(states)} states but {len(drafts)} drafts")
    if not states:
        return DraftMasks(torch.zeros(0, 0, dtype=torch.bool), (), ())
    vocab_size = states[0].compiled.vocab_size
    if any(state.compiled.vocab_size != vocab_size for state in states):
        raise ValueError("the states' grammars are compiled for different vocabulary sizes")
    drafts = [[int(token) for token in draft] for draft in drafts]
    offsets, valid, jobs, job_states = [], [], [], []
    rows = 0
    for state, draft in zip(states, drafts):
        offsets.append(rows)
        valid.append(state.valid_prefix(draft))
        rows += len(draft) + 1
    words = np.zeros((rows, _words(vocab_size)), dtype=np.int32)
    for state, draft, offset, count in zip(states, drafts, offsets, valid):
        if state.ended:
            state.bitmask(words[offset])
            continue
        ordinary = draft[:count]
        if ordinary and ordinary[-1] in state._eos:  # the end is not passed to the engine: its row is set here
            ordinary = ordinary[:-1]
            _set_bits(words[offset + count], state._eos)
        if ordinary:
            jobs.append((state._matcher, offset, ordinary))
            job_states.append(state)
        else:  # llguidance's batch call takes no empty draft (nor a lone end token)
            state.bitmask(words[offset])
    if jobs:
        from llguidance.numpy import fill_next_token_bitmask_par_with_draft_tokens

        fill_next_token_bitmask_par_with_draft_tokens(_executor(), jobs, words)
        for (matcher, offset, ordinary), state in zip(jobs, job_states):  # special tokens settled at each row's state
            special = state.compiled.special
            rows = words[offset:offset + len(ordinary) + 1].view(np.uint32)
            taken = 0  # the state walks the draft once, to each row that allows a special token in turn
            try:
                for row in range(len(rows)):
                    allowed = special.allowed_in(rows[row])
                    if not allowed:
                        continue
                    if matcher.try_consume_tokens(ordinary[taken:row]) != row - taken:
                        raise GrammarError("the grammar engine refused a draft it had validated")
                    taken = row
                    state._settle_special(words[offset + row], allowed)
            finally:
                state._rollback_engine(taken)
    for state in states:
        state._check()
    return DraftMasks(unpack_masks(words, vocab_size), tuple(offsets), tuple(valid))
