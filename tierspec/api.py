"""One-line generation: ``tierspec.generate("prompt")`` and its streaming form."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .decode import DecodeConfig, GenerationStats, PromptError, Verifiers, decode
from .methods import DEFAULT_METHOD, MethodOptions, build_method
from .models import DEFAULT_MODEL, CachedModel, LoadedModel, load_model
from .sampling import SamplingConfig


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    stats: GenerationStats


def _as_model(model: LoadedModel | str | None) -> LoadedModel | None:
    if model is None or isinstance(model, LoadedModel):
        return model
    return load_model(model)


def encode_prompt(target: LoadedModel, prompt: str | list[int] | torch.Tensor, chat_template: bool = True) -> torch.Tensor:
    """Token ids [n] for a text prompt (through the chat template when the tokenizer has one)."""
    if not isinstance(prompt, str):
        return torch.as_tensor(prompt, dtype=torch.long)
    if not prompt.strip():
        raise PromptError("the prompt is empty: give some text")
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise PromptError(f"model '{target.identity.name}' has no tokenizer: pass token ids instead of text")
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def eos_ids(target: LoadedModel) -> tuple[int, ...]:
    ids = set()
    for source in (getattr(target.model, "generation_config", None), target.model.config, target.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def stream(
    prompt: str | list[int] | torch.Tensor,
    *,
    target: LoadedModel | str = DEFAULT_MODEL,
    method: str = DEFAULT_METHOD,
    drafter: LoadedModel | str | None = None,
    num_draft: int = 5,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    chat_template: bool = True,
    options: MethodOptions = MethodOptions(),
    stats: GenerationStats | None = None,
    token_ids: list[int] | None = None,
) -> Iterator[str]:
    """Yield the generated text piece by piece as the decode loop commits tokens.

    Pass ``stats`` (a fresh GenerationStats) and/or ``token_ids`` (a list) to receive the
    statistics and the generated ids as they accumulate.
    """
    import time

    target = _as_model(target)
    drafter = _as_model(drafter)
    if options.num_draft != num_draft:
        from dataclasses import replace

        options = replace(options, num_draft=num_draft)
    built = build_method(method, target, drafter, options)
    prompt_ids = encode_prompt(target, prompt, chat_template)
    config = DecodeConfig(
        max_new_tokens=max_new_tokens,
        num_draft=built.num_draft or num_draft,
        sampling=SamplingConfig(temperature, top_k, top_p),
        eos_token_ids=eos_ids(target),
    )
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    stats = stats if stats is not None else GenerationStats()
    token_ids = token_ids if token_ids is not None else []
    tokenizer = target.tokenizer
    shown = ""
    started = time.perf_counter()
    runner = CachedModel(target.model)
    verifiers = Verifiers(runner, slim_mask=built.slim_mask, forward_costs=built.forward_costs)
    for step in decode(runner, built.drafter, built.rule, prompt_ids, config, generator, verifiers):
        stats.add(step.cycle)
        token_ids.extend(step.new_tokens)
        stats.wall_seconds = time.perf_counter() - started
        if tokenizer is None:
            continue
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
        # Hold back a trailing partial UTF-8 sequence until its next token arrives.
        if text.endswith("\ufffd") and not step.finished:
            continue
        if len(text) > len(shown) and text.startswith(shown):
            yield text[len(shown) :]
            shown = text
    stats.wall_seconds = time.perf_counter() - started


def generate(prompt: str | list[int] | torch.Tensor, *, target: LoadedModel | str = DEFAULT_MODEL, **kwargs) -> Generation:
    """Generate a completion; see ``stream`` for the arguments. Returns text, ids and stats."""
    target = _as_model(target)
    stats = GenerationStats()
    token_ids: list[int] = []
    for _ in stream(prompt, target=target, stats=stats, token_ids=token_ids, **kwargs):
        pass
    text = target.tokenizer.decode(token_ids, skip_special_tokens=True) if target.tokenizer is not None else ""
    return Generation(text, token_ids, stats)
