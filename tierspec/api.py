"""One-call generation: ``tierspec.generate`` (the whole text) and ``tierspec.stream`` (the text
piece by piece), with one signature between them; a target named by a string is loaded once per
process (``shared_model``) and reused by every later call, like a pipeline."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .decode import DecodeConfig, DecodeRun, GenerationStats, TokenLogprob
from .errors import PromptError, TierspecError
from .limits import check_num_draft
from .methods import Method, MethodOptions, build_method, default_method
from .models import DEFAULT_MODEL, LoadedModel, auto_dtype, load_model, resolve_device, resolve_dtype
from .prompting import encode_prompt, eos_ids
from .sampling import SamplingConfig

__all__ = ["Generation", "TextStream", "generate", "shared_model", "stream", "stream_method"]

SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)  # int64, as OpenAI's ``seed``; torch's generator takes any of them


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats


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
        # "bfloat16" and torch.bfloat16, or "model" and "./model", share one load.
        name = str(Path(spec).resolve()) if Path(spec).exists() else str(spec)
        key = (name, auto_dtype(spec, device) if isinstance(dtype, str) and dtype == "auto" else resolve_dtype(dtype, device),
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
    """The generation of a built ``method`` after ``prompt_ids`` [n]. ``stream`` and the server
    both start generations here, so a seed means one thing in both: it seeds this generation's
    draws and nothing else."""
    check_seed(seed)
    return TextStream(DecodeRun(target, method, prompt_ids, config, seed), target)


def stream(
    prompt: str | list[int] | torch.Tensor,
    *,
    target: LoadedModel | str = DEFAULT_MODEL,
    method: str | None = None,
    drafter: LoadedModel | str | None = None,
    num_draft: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat_template: bool = True,
    options: MethodOptions = MethodOptions(),
) -> TextStream:
    """Generate after ``prompt``, returning the text piece by piece as the loop commits tokens
    (a ``TextStream``: iterate it or call ``next``; its ``stats`` and ``token_ids`` fill as it
    runs).

    ``prompt``: text (through the chat template unless ``chat_template=False``) or token ids.
    ``target``, ``drafter``: a loaded model, or a name or path loaded once per process
    (``shared_model``). ``method``: None = ``methods.default_method(target)`` (the hybrid where a
    draft head exists for the target, else adaptive-pld). ``num_draft`` overrides
    ``options.num_draft`` (γ of the fixed-length methods). ``temperature`` 0 is greedy;
    ``top_k`` 0 and ``top_p`` 1 keep every token. ``seed`` (int64): the same seed gives the
    same text (README, "Same seed, same text"); None draws a fresh one.
    """
    check_num_draft(num_draft)  # before any model is loaded
    target = _as_model(target)
    drafter = _as_model(drafter)
    if num_draft is not None and num_draft != options.num_draft:
        options = replace(options, num_draft=num_draft)
    sampling = SamplingConfig(temperature, top_k, top_p)
    if isinstance(prompt, str):
        check_text(prompt)
    built = build_method(method or default_method(target, options), target, drafter, options)
    prompt_ids = encode_prompt(target, prompt, chat_template)
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_ids(target))
    return stream_method(target, built, prompt_ids, config, seed)


def _is_batch(prompt) -> bool:
    """A list of prompts (texts, or token-id lists / tensors), not one prompt given as token ids."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0
            and all(isinstance(p, (str, list, tuple, torch.Tensor)) for p in prompt))


def generate(
    prompt: str | list[int] | torch.Tensor | list[str] | list[list[int]],
    *,
    target: LoadedModel | str = DEFAULT_MODEL,
    method: str | None = None,
    drafter: LoadedModel | str | None = None,
    num_draft: int | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat_template: bool = True,
    options: MethodOptions = MethodOptions(),
) -> Generation:
    """Generate after ``prompt`` and return the whole ``Generation`` (text, token ids, stats).
    The arguments are ``stream``'s (see there); the text is the streamed pieces joined.

    A list of prompts (texts, or token-id lists) returns a list of ``Generation``s, in order: on a
    model on the pass engine they run together, several per pass (``batch.BatchDecoder``, up to
    ``MAX_BATCH`` at once), and each is exactly what ``generate`` of that prompt alone gives (with
    the same ``seed``); elsewhere one after another."""
    if _is_batch(prompt):
        return generate_batch(list(prompt), target=target, method=method, drafter=drafter, num_draft=num_draft,
                              max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, chat_template=chat_template, options=options)
    text_stream = stream(prompt, target=target, method=method, drafter=drafter, num_draft=num_draft,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                         chat_template=chat_template, options=options)
    for _ in text_stream:
        pass
    return Generation(text_stream.text, text_stream.token_ids, text_stream.stats)


MAX_BATCH = 8  # generations ``generate`` runs at once for a list of prompts (the server's default too)


def generate_batch(prompts: list, *, target: LoadedModel | str = DEFAULT_MODEL, method: str | None = None,
                   drafter: LoadedModel | str | None = None, num_draft: int | None = None, max_new_tokens: int = 128,
                   temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                   chat_template: bool = True, options: MethodOptions = MethodOptions(),
                   max_batch: int = MAX_BATCH) -> list[Generation]:
    """``generate`` of every prompt, several per pass (see ``generate``); a prompt's result is its
    solo result. Each generation gets its own method (drafter and policy state are per generation)."""
    from .batch import BatchDecoder, check_batchable
    from .engine import runs_on_engine

    check_num_draft(num_draft)  # before any model is loaded
    target = _as_model(target)
    drafter = _as_model(drafter)
    if num_draft is not None and num_draft != options.num_draft:
        options = replace(options, num_draft=num_draft)
    check_seed(seed)
    name = method or default_method(target, options)
    sampling = SamplingConfig(temperature, top_k, top_p)
    config = DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos_ids(target))
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text(prompt)
        encoded.append(encode_prompt(target, prompt, chat_template))
    first = build_method(name, target, drafter, options)
    batchable = runs_on_engine(target.model)
    if batchable:
        try:
            check_batchable(first)
        except TierspecError:
            batchable = False
    if not batchable:  # one after another, as ``generate`` would
        out = []
        for index, prompt_ids in enumerate(encoded):
            built = first if index == 0 else build_method(name, target, drafter, options)
            text_stream = stream_method(target, built, prompt_ids, config, seed)
            for _ in text_stream:
                pass
            out.append(Generation(text_stream.text, text_stream.token_ids, text_stream.stats))
        return out
    built = iter([first])  # the first generation's method is the one checked above
    runs = BatchDecoder(target, max_batch=max(1, min(max_batch, len(encoded)))).run_all(
        encoded, lambda: next(built, None) or build_method(name, target, drafter, options), config, seed)
    return [Generation(IncrementalDetokenizer(target.tokenizer).add(run.token_ids, final=True) if target.tokenizer
                       else "", run.token_ids, run.stats) for run in runs]
