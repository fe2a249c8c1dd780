"""One-call generation: ``tierspec.generate`` (the whole text) and ``tierspec.stream`` (the text
piece by piece), with one signature between them; a target named by a string is loaded once per
process (``shared_model``) and reused by every later call, like a pipeline."""

from __future__ import annotations

import inspect
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .decode import DecodeConfig, DecodeRun, GenerationStats, TokenLogprob, check_constraint_method
from .engine import threads_for
from .errors import PromptError
from .limits import check_num_draft
from .methods import Method, MethodOptions, build_method, default_method
from .models import DEFAULT_MODEL, LoadedModel, load_model, on_engine_defaults, resolve_device, resolve_dtype
from .prompting import encode_prompt, eos_ids
from .sampling import SamplingConfig

__all__ = ["Generation", "GenerationSettings", "TextStream", "generate", "shared_model", "stream", "stream_method"]

SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # int64, as OpenAI's ``seed``; torch's generator takes any of them


@dataclass
class Generation:
    """A finished generation: its text, token ids and statistics, and why it ended —
    ``finish_reason`` "stop" (an end token, or its constraint complete) or "length" (the token
    budget: a constrained text is then incomplete, not valid under its constraint)."""

    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str | None = None


# ---- models loaded once per process ----------------------------------------------------------------


@dataclass
class _SharedEntry:
    lock: threading.Lock = field(default_factory=threading.Lock)
    model: LoadedModel | None = None


class _SharedModels:
    """Models by (spec, load options), each loaded at most once: threads asking for the same
    one wait for a single load, different ones load in parallel; a failed load is not kept."""

    def __init__(self):
        self._lock = threading.Lock()
        self._entries: dict[tuple, _SharedEntry] = {}

    def get(self, spec, dtype, device, kernels: str, implementation: str) -> LoadedModel:
        # A path is keyed by the file it names, a dtype or device by what it resolves to, so that
        # "bfloat16" and torch.bfloat16, or "model" and "./model", share one load; "auto" on the
        # engine's default numerics is a load of its own (no named dtype computes as it does).
        name = str(Path(spec).resolve()) if Path(spec).exists() else str(spec)
        auto = isinstance(dtype, str) and dtype == "auto"
        key = (name, "engine default" if auto and on_engine_defaults(spec, device) else resolve_dtype(dtype, device),
               resolve_device(device), kernels, implementation)
        with self._lock:
            entry = self._entries.setdefault(key, _SharedEntry())
        with entry.lock:
            if entry.model is None:
                entry.model = load_model(spec, dtype=dtype, device=device, kernels=kernels,
                                         implementation=implementation)
            return entry.model


# The process-wide store behind ``shared_model``: sharing across callers is its whole purpose.
_SHARED = _SharedModels()


def shared_model(spec: str | os.PathLike = DEFAULT_MODEL, *, dtype: torch.dtype | str = "auto",
                 device: str | torch.device = "cpu", kernels: str = "auto", implementation: str = "auto") -> LoadedModel:
    """``load_model(spec, ...)`` (same arguments), loaded once per process for each spec and
    options and returned to every later caller: ``generate(..., target="smollm2-135m")`` calls
    this, so a second call does not load the model again. Safe to call from several threads."""
    return _SHARED.get(spec, dtype, device, kernels, implementation)


def _as_model(model: LoadedModel | str | os.PathLike | None) -> LoadedModel | None:
    if model is None or isinstance(model, LoadedModel):
        return model
    return shared_model(model)


# ---- text as the loop commits tokens --------------------------------------------------------------


class IncrementalDetokenizer:
    """Text of a growing token sequence without re-decoding all of it each step.

    Each step decodes only the tokens since the previous step's read point plus the tokens of
    the step before (``prefix``), whose text is known: the new piece is the difference. The
    context tokens keep a tokenizer's merging rules (leading spaces, byte fallback) right across
    the boundary. A character split over several tokens decodes as U+FFFD until its last byte
    arrives: a trailing U+FFFD is held back until then, and at the end of the generation (text
    cut by the token budget inside a character) dropped rather than shown. (A U+FFFD the model
    really wrote as the very last character is dropped too: the decoded text cannot tell them
    apart.) The tokens are read, never kept: the generation's committed sequence holds them.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.prefix = 0  # first token of the decoded window
        self.read = 0  # tokens whose text has been emitted

    def add(self, tokens: Sequence[int], final: bool = False) -> str:
        """The new text after ``tokens``, every token generated so far (a list, or the run's
        ``decode.GeneratedTokens``: only the window is read)."""
        end = len(tokens)
        known = self.tokenizer.decode(tokens[self.prefix : self.read], skip_special_tokens=True)
        window = self.tokenizer.decode(tokens[self.prefix : end], skip_special_tokens=True)
        if final:
            window = window.rstrip("\ufffd")
        elif window.endswith("\ufffd"):
            return ""
        if len(window) <= len(known):
            return ""
        self.prefix, self.read = self.read, end
        return window[len(known):]


class TextStream:
    """The text of one generation, an iterator of pieces as the loop commits tokens (``next``
    works, as on a generator). ``stats`` and ``token_ids`` (the ``DecodeRun``'s) grow as it runs
    and are complete once it is exhausted; ``text`` is everything so far; ``logprobs`` the
    records of the tokens so far (with ``DecodeConfig.logprobs``; ``prompt_logprobs`` with
    ``score_prompt``). ``close()`` stops the generation."""

    def __init__(self, run: DecodeRun, target: LoadedModel):
        self._run = run
        self.target = target
        self.text = ""
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self._detok = IncrementalDetokenizer(target.tokenizer) if target.tokenizer is not None else None
        self._pieces = self._texts()

    @property
    def stats(self) -> GenerationStats:
        return self._run.stats

    @property
    def token_ids(self) -> list[int]:
        return self._run.token_ids

    @property
    def finish_reason(self) -> str | None:
        """"stop" or "length" once the stream is exhausted (``Generation.finish_reason``); None before."""
        return self._run.finish_reason

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def _texts(self) -> Iterator[str]:
        for step in self._run:
            if step.logprobs is not None:
                self.logprobs.extend(step.logprobs)
            if step.prompt_logprobs is not None:
                self.prompt_logprobs = step.prompt_logprobs
            if self._detok is None:
                continue
            piece = self._detok.add(step.committed.generated_view, final=step.finished)
            if piece:
                self.text += piece
                yield piece

    def held(self):
        """``DecodeRun.held``: iterate inside it where the caller's code between pieces uses no torch
        (``generate``, the CLI) — each step then skips leaving and entering torch's modes."""
        return self._run.held()

    def close(self) -> None:
        """Stop the generation (a suspended stream holds the model's cache until closed)."""
        self._pieces.close()
        self._run.close()


def check_text(prompt: str) -> str:
    """Refuse text that is not valid Unicode (e.g. argv bytes that were not UTF-8 arrive as
    lone surrogates) with a clear message instead of a tokenizer traceback."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PromptError(f"the prompt is not valid UTF-8 text (at character {error.start}); "
                          "give UTF-8 input") from None
    return prompt


def check_seed(seed: int | None) -> None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise PromptError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (int64), got {seed!r}")


def stream_method(target: LoadedModel, method: Method, prompt_ids: torch.Tensor, config: DecodeConfig,
                  seed: int | None) -> TextStream:
    """The generation of a built ``method`` after ``prompt_ids`` [n]: ``stream`` starts its
    generations here, so a seed means one thing everywhere: it seeds this generation's draws and
    nothing else."""
    check_seed(seed)
    return TextStream(DecodeRun(target, method, prompt_ids, config, seed), target)


# ---- the keyword arguments of ``stream`` and ``generate``, declared once ----------------------------


@dataclass(frozen=True)
class GenerationSettings:
    """What ``stream`` and ``generate`` take after the prompt (keyword arguments of both; this
    declaration is their signature).

    ``target``, ``drafter``: a loaded model, or a name or path loaded once per process
    (``shared_model``). ``method``: None = ``methods.default_method(target)`` (the hybrid where a
    draft head exists for the target, else adaptive-pld). ``num_draft``: the generation's largest
    draft (γ of the fixed-length methods, the longest draft a cost-aware one may choose, the deepest
    tree; refused by ``ar`` and PEARL; None: the method's own, ``options.num_draft``).
    ``max_new_tokens``: at most that many tokens. ``temperature`` 0 is greedy; ``top_k`` 0 and
    ``top_p`` 1 keep every token. ``seed`` (int64): the same seed gives the same text (README,
    "Same seed, same text"); None draws a fresh one. ``chat_template``: text prompts go through the
    model's chat template (False: fed as raw text). ``options``: the method's parameters
    (``methods.MethodOptions``; None: its defaults).

    Structured output (docs/structured.md), at most one of: ``json_schema`` (a JSON schema, as a
    dict or JSON text: the text is JSON valid against it), ``json_object`` (any JSON object),
    ``regex`` (the text matches it whole), ``grammar`` (a Lark grammar, llguidance's dialect).
    Every lossless method's constrained text is constrained ``ar``'s; a lossy method is refused."""

    target: LoadedModel | str = DEFAULT_MODEL
    method: str | None = None
    drafter: LoadedModel | str | None = None
    num_draft: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    chat_template: bool = True
    options: MethodOptions = MethodOptions()
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        # None: the method's defaults, as for every other optional setting here; anything else
        # that is not a MethodOptions failed deep in the method's construction with an AttributeError
        if self.options is None:
            object.__setattr__(self, "options", MethodOptions())
        elif not isinstance(self.options, MethodOptions):
            raise TypeError(f"options must be a tierspec.methods.MethodOptions (or None), not {type(self.options).__name__}")
        if self.chat_template not in (True, False):  # "no" is truthy: it would have meant the template
            raise PromptError(f"chat_template is True or False, got {self.chat_template!r}")


def grammar_spec(json_schema=None, json_object: bool = False, regex: str | None = None, grammar: str | None = None):
    """The ``grammar.GrammarSpec`` of the structured-output settings (None: unconstrained);
    more than one given is a ``PromptError``."""
    from .grammar import GrammarSpec

    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object), ("regex", regex),
                                      ("grammar", grammar)) if value is not None and value is not False]
    if len(given) > 1:
        raise PromptError(f"give at most one of json_schema, json_object, regex and grammar (got {', '.join(given)})")
    if json_object not in (True, False):
        raise PromptError(f"json_object is True or False, got {json_object!r}")
    if json_schema is not None:
        return GrammarSpec.json_schema(json_schema)
    if json_object:
        return GrammarSpec.json_object()
    if regex is not None:
        return GrammarSpec.regex(regex)
    if grammar is not None:
        return GrammarSpec.lark(grammar)
    return None


def compiled_constraint(target: LoadedModel, spec):
    """``spec`` (a ``GrammarSpec`` or None) compiled for ``target``'s tokenizer and vocabulary."""
    if spec is None:
        return None
    from .grammar import GrammarError, compile_grammar

    if target.tokenizer is None:
        raise GrammarError("structured output needs the model's tokenizer (this model has none)")
    return compile_grammar(spec, target.tokenizer, target.vocab_size, eos_ids(target))


def _takes_settings(function):
    """``function(prompt, **settings)`` shown (``inspect.signature``, ``help``) with the prompt and
    ``GenerationSettings``' fields as its keyword-only parameters, and refusing any other keyword
    as a call to a function of that signature would."""
    prompt = inspect.signature(function).parameters["prompt"]
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
                for f in fields(GenerationSettings)]
    function.__signature__ = inspect.Signature([prompt, *keywords],
                                               return_annotation=inspect.signature(function).return_annotation)
    return function


@dataclass(frozen=True)
class _Prepared:
    """A call's settings resolved once: the models loaded, the method built, the run-time config."""

    target: LoadedModel
    method: Method
    config: DecodeConfig
    seed: int | None
    chat_template: bool

    def prompt_ids(self, prompt: str | list[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(prompt, str):
            check_text(prompt)
        elif isinstance(prompt, (list, tuple)) and not prompt:
            raise PromptError("the prompt is empty (an empty list: give text, token ids, or a list of prompts)")
        elif not isinstance(prompt, (list, tuple, torch.Tensor)):  # None, bytes: torch's own errors said less
            raise PromptError(f"a prompt is text, token ids (a list or a tensor) or a list of prompts, not "
                              f"{type(prompt).__name__}")
        return encode_prompt(self.target, prompt, self.chat_template)


def _prepare(settings: dict) -> _Prepared:
    """``settings`` (``GenerationSettings``' fields, a call's keywords) checked and resolved."""
    given = GenerationSettings(**settings)  # an unknown keyword is a TypeError naming it
    check_num_draft(given.num_draft)  # before any model is loaded
    check_seed(given.seed)
    sampling = SamplingConfig(given.temperature, given.top_k, given.top_p)
    spec = grammar_spec(given.json_schema, given.json_object, given.regex, given.grammar)  # before any model is loaded
    target, drafter = _as_model(given.target), _as_model(given.drafter)
    config = DecodeConfig(max_new_tokens=given.max_new_tokens, sampling=sampling, eos_token_ids=eos_ids(target),
                          num_draft=given.num_draft, constraint=compiled_constraint(target, spec))
    name = default_method(target, given.options) if given.method is None else given.method  # "" is no method's name
    method = build_method(name, target, drafter, given.options)
    parts = method.generation(config.num_draft)  # a num_draft the method refuses is refused now, not at the first token
    check_constraint_method(method, parts.rule, config)  # and a lossy method under a grammar
    return _Prepared(target, method, config, given.seed, given.chat_template)


@_takes_settings
def stream(prompt: str | list[int] | torch.Tensor, **settings) -> TextStream:
    """Generate after ``prompt``, returning the text piece by piece as the loop commits tokens
    (a ``TextStream``: iterate it or call ``next``; its ``stats`` and ``token_ids`` fill as it
    runs). ``prompt``: text (through the chat template unless ``chat_template=False``) or token
    ids. The keyword arguments are ``GenerationSettings``' (see there)."""
    if _is_batch(prompt):
        raise PromptError("stream takes one prompt; generate takes a list of prompts (one Generation each)")
    prepared = _prepare(settings)
    return stream_method(prepared.target, prepared.method, prepared.prompt_ids(prompt), prepared.config,
                         prepared.seed)


def _is_batch(prompt) -> bool:
    """A list of prompts (texts, or token-id lists / tensors), not one prompt given as token ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt))


MAX_BATCH = 8  # generations ``generate`` runs at once for a list of prompts on the pass engine (the server's default too)


@_takes_settings
def generate(prompt: str | list[int] | torch.Tensor | list[str] | list[list[int]],
             **settings) -> Generation | list[Generation]:
    """Generate after ``prompt`` and return the whole ``Generation`` (text, token ids, stats).
    The keyword arguments are ``stream``'s (``GenerationSettings``); the text is the streamed
    pieces joined.

    A list of prompts (texts, or token-id lists) returns a list of ``Generation``s, in order, run
    by the one executor a server runs (``batch.BatchDecoder``): on a model on the pass engine
    several per pass (up to ``MAX_BATCH`` at once), elsewhere one after another; each is exactly
    what ``generate`` of that prompt alone gives (with the same ``seed``)."""
    prepared = _prepare(settings)
    if not _is_batch(prompt):
        text_stream = stream_method(prepared.target, prepared.method, prepared.prompt_ids(prompt), prepared.config,
                                    prepared.seed)
        with text_stream.held():
            for _ in text_stream:
                pass
        return Generation(text_stream.text, text_stream.token_ids, text_stream.stats, text_stream.finish_reason)
    from .batch import BatchDecoder
    from .engine import runs_on_engine

    target = prepared.target
    encoded = [prepared.prompt_ids(p) for p in prompt]
    width = min(MAX_BATCH, len(encoded)) if runs_on_engine(target.model) else 1
    with threads_for(target.model):
        done = BatchDecoder(target, max_batch=width).run_all(encoded, prepared.method, prepared.config, prepared.seed)
    return [Generation(IncrementalDetokenizer(target.tokenizer).add(s.token_ids, final=True) if target.tokenizer
                       else "", s.token_ids, s.stats, s.finish_reason()) for s in done]
