"""Turning a user's prompt into token ids (chat template), and the model's end-of-sequence ids."""

from __future__ import annotations

import re

import torch

from .errors import PromptError
from .models import LoadedModel


def encode_prompt(target: LoadedModel, prompt: str | list[int] | torch.Tensor, chat_template: bool = True) -> torch.Tensor:
    """Token ids [n] for a text prompt (through the chat template when the tokenizer has one)."""
    if not isinstance(prompt, str):
        return torch.as_tensor(prompt)
    if not prompt.strip():
        raise PromptError("the prompt is empty: give some text")
    tokenizer = target.tokenizer
    if tokenizer is None:
        raise PromptError(f"model '{target.identity.name}' has no tokenizer: pass token ids instead of text")
    return torch.tensor(prompt_ids(tokenizer, prompt, chat_template), dtype=torch.long)


def prompt_ids(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """The ids of a text prompt: a user message through the chat template (``chat_ids``) where
    the tokenizer has one, else the raw text (whose special-token strings stay special: a raw
    prompt is the caller's own format)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt)["input_ids"]


def eos_ids(target: LoadedModel) -> tuple[int, ...]:
    ids = set()
    for source in (getattr(target.model, "generation_config", None), target.model.config, target.tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def encode_messages(target: LoadedModel, messages: list[dict]) -> torch.Tensor:
    """Token ids [n] of a chat (``[{"role": ..., "content": ...}, ...]``) through the model's chat
    template, ending with the prompt for the assistant's turn."""
    tokenizer = target.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"model '{target.identity.name}' has no chat template: use the completions endpoint")
    if not messages or not any(str(m.get("content", "")).strip() for m in messages):
        raise PromptError("the conversation is empty: give at least one message with text")
    return torch.tensor(chat_ids(tokenizer, messages), dtype=torch.long)


# Stands for message i while the template is rendered: private-use characters, which no template
# tests for and no tokenizer gives a meaning.
_SENTINEL = "\U000f0000{}\U000f0001"
_SENTINEL_PATTERN = re.compile("\U000f0000(\\d+)\U000f0001")


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat through the tokenizer's chat template, every message's content
    tokenised as text: a special-token string in content (``<|im_end|>``) becomes the tokens of
    its characters, never the special token, so no message can end its turn and open one of
    another role. The template's own markers are special tokens.

    The template is rendered a second time with each content replaced by a sentinel, which
    splits the chat into the template's text and the contents. Special tokens are matched in
    the template's text only, and each run of text between two of them (template text and
    content together, as the tokenizer sees it when it splits at special tokens) is tokenised
    with special tokens off. Content without special-token strings thus gets exactly the ids of
    the rendered chat tokenised whole. A template that changes content beyond trimming it
    cannot be split so; with such a template, content holding a special-token string is refused."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    specials = {token.content: index for index, token in tokenizer.added_tokens_decoder.items() if token.special}
    if not specials:
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    split = _split_chat(tokenizer, messages, add_generation_prompt, text)
    if split is None:
        found = sorted({s for m in messages for s in specials if s in str(m.get("content", ""))})
        if found:
            raise PromptError(f"a message holds the special token {found[0]!r} as text, and this model's chat "
                              "template changes message content in a way tierspec cannot follow; remove it")
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    templates, contents = split
    marker = re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids: list[int] = []
    run: list[str] = []  # text since the last special token

    def flush() -> None:
        text = "".join(run)
        if text:  # special tokens off where content holds one (else there is nothing to turn off)
            ids.extend(tokenizer(text, add_special_tokens=False, split_special_tokens=bool(marker.search(text)))["input_ids"])
        run.clear()

    for i, template in enumerate(templates):
        position = 0
        for match in marker.finditer(template):
            run.append(template[position : match.start()])
            flush()
            ids.append(specials[match.group()])
            position = match.end()
        run.append(template[position:])
        if i < len(contents):
            run.append(contents[i])
    flush()
    return ids


def _split_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, text: str):
    """(template texts T_0..T_n, contents C_1..C_n) with T_0 C_1 T_1 … C_n T_n == ``text``, the
    rendered chat (a template may repeat or leave out a message), or None when the template
    does more to content than insert it, whole or trimmed."""
    if not all(isinstance(m.get("content"), str) for m in messages):
        return None
    marked = [{**m, "content": _SENTINEL.format(i)} for i, m in enumerate(messages)]
    parts = _SENTINEL_PATTERN.split(tokenizer.apply_chat_template(marked, add_generation_prompt=add_generation_prompt,
                                                                  tokenize=False))
    templates, order = parts[0::2], [int(i) for i in parts[1::2]]
    for form in (str, str.strip):  # inserted as it is, or trimmed (Llama 3's template trims)
        contents = [form(messages[i]["content"]) for i in order]
        if templates[0] + "".join(c + t for c, t in zip(contents, templates[1:])) == text:
            return templates, contents
    return None
