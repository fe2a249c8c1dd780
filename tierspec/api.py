"""One-line generation: ``tierspec.generate("prompt")`` and its streaming form ``tierspec.stream``."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Iterator

import torch

from .decode import DecodeConfig, GenerationStats, PromptError, decode
from .methods import MethodOptions, build_method, default_method
from .models import DEFAULT_MODEL, LoadedModel, load_model
from .prompting import encode_prompt, eos_ids
from .sampling import SamplingConfig

__all__ = ["Generation", "TextStream", "encode_prompt", "eos_ids", "generate", "stream"]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def _as_model(model: LoadedModel | str | None) -> LoadedModel | None:
    if model is None or isinstance(model, LoadedModel):
        return model
    return load_model(model)


class IncrementalDetokenizer:
    """Text of a growing token list without re-decoding all of it each step.

    Each step decodes only the tokens since the previous step's read point plus the tokens of
    the step before (``prefix``), whose text is known: the new piece is the difference. The
    context tokens keep a tokenizer's merging rules (leading spaces, byte fallback) right across
    the boundary. A trailing incomplete UTF-8 character (decoded as U+FFFD) is held back until
    the token that completes it arrives, except at the end of the generation.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # first token of the decoded window
        self.read = 0  # tokens whose text has been emitted

    def _text(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def add(self, new_tokens: list[int], final: bool = False) -> str:
        self.tokens.extend(new_tokens)
        known = self._text(self.prefix, self.read)
        window = self._text(self.prefix, len(self.tokens))
        if len(window) <= len(known) or (window.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return window[len(known):]


class TextStream:
    """The text of one generation, piece by piece (iterate it). ``stats`` and ``token_ids``
    grow as it runs and are complete once iteration ends; ``text`` is everything so far."""

    def __init__(self, steps, target: LoadedModel):
        self._steps = steps
        self.target = target
        self.stats = GenerationStats()
        self.token_ids: list[int] = []
        self.text = ""
        self._detok = IncrementalDetokenizer(target.tokenizer) if target.tokenizer is not None else None

    def __iter__(self) -> Iterator[str]:
        started = time.perf_counter()
        for step in self._steps:
            self.stats.add(step.cycle)
            self.token_ids.extend(step.new_tokens)
            self.stats.wall_seconds = time.perf_counter() - started
            if self._detok is None:
                continue
            piece = self._detok.add(step.new_tokens, final=step.finished)
            if piece:
                self.text += piece
                yield piece
        self.stats.wall_seconds = time.perf_counter() - started

    def close(self) -> None:
        """Stop the generation (a suspended stream holds the model's cache until closed)."""
        self._steps.close()


def check_text(prompt: str) -> str:
    """Refuse text that is not valid Unicode (e.g. argv bytes that were not UTF-8 arrive as
    lone surrogates) with a clear message instead of a tokenizer traceback."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PromptError(f"the prompt is not valid UTF-8 text (at character {error.start}); "
                          "give UTF-8 input") from None
    return prompt


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
    """Generate after ``prompt``; iterate the returned ``TextStream`` for the text as the loop
    commits tokens (its ``stats`` and ``token_ids`` fill as it runs).

    ``method``: None = ``methods.default_method(target)`` (the hybrid where a draft head exists
    for the target, else adaptive-pld). ``num_draft`` overrides ``options.num_draft`` (γ of the
    fixed-length methods). ``seed``: the same seed gives the same text (README, "Same seed, same
    text"); None draws a fresh one.
    """
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
    return TextStream(decode(target, built, prompt_ids, config, seed), target)


def generate(prompt: str | list[int] | torch.Tensor, *, target: LoadedModel | str = DEFAULT_MODEL, **kwargs) -> Generation:
    """Generate a completion; see ``stream`` for the arguments. Returns text, ids and stats."""
    target = _as_model(target)
    text_stream = stream(prompt, target=target, **kwargs)
    for _ in text_stream:
        pass
    text = target.tokenizer.decode(text_stream.token_ids, skip_special_tokens=True) if target.tokenizer is not None else ""
    return Generation(text, text_stream.token_ids, text_stream.stats)
