"""Turning a user's prompt into token ids (chat template), and the model's end-of-sequence ids."""

from __future__ import annotations

import torch

from .decode import PromptError
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


def encode_messages(target: LoadedModel, messages: list[dict]) -> torch.Tensor:
    """Token ids [n] of a chat (``[{"role": ..., "content": ...}, ...]``) through the model's chat
    template, ending with the prompt for the assistant's turn."""
    tokenizer = target.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"model '{target.identity.name}' has no chat template: use the completions endpoint")
    if not messages or not any(str(m.get("content", "")).strip() for m in messages):
        raise PromptError("the conversation is empty: give at least one message with text")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
