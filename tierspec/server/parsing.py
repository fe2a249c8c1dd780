"""A request body → a job for the engine: strict request models (a wrong type is refused, never
coerced; unknown fields are refused), JSON parsing, tokenisation and the context check. All of
it is CPU work: the handlers run ``prepare`` on a thread, off the event loop."""

from __future__ import annotations

import asyncio
import json
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..api import SEED_RANGE
from ..decode import DecodeConfig
from ..errors import TierspecError
from ..methods import check_method_name
from ..models import LoadedModel
from ..prompting import encode_messages, encode_prompt
from ..sampling import SamplingConfig
from .engine import ApiError, Engine, Job


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by both endpoints. Strict: a wrong type is an error, never coerced
    (``"max_tokens": "5"`` and ``"stream": "yes"`` are refused); unknown fields are refused
    (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt_param: ClassVar[str]  # the field an error about the prompt names
    default_max_tokens: ClassVar[int | None]  # None: the rest of the model's context

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    user: str | None = None
    # tierspec's own fields
    method: str | None = None
    top_k: int = Field(default=0, ge=0)
    num_draft: int | None = Field(default=None, ge=0)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if value is not None and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not stop for stop in value or []):
            raise ValueError("stop sequences must not be empty")
        return value

    def prompt_ids(self, target: LoadedModel) -> torch.Tensor:
        """The prompt's token ids [n]."""
        raise NotImplementedError

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    prompt_param = "prompt"
    default_max_tokens = 16  # OpenAI's default for completions

    prompt: str

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("give one prompt per request")
            value = value[0]
        return value

    @field_validator("prompt")
    @classmethod
    def _some_text(cls, value):
        if not value.strip():
            raise ValueError("the prompt is empty")
        return value

    def prompt_ids(self, target: LoadedModel) -> torch.Tensor:
        return encode_prompt(target, self.prompt, chat_template=False)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(GenerationRequest):
    prompt_param = "messages"
    default_max_tokens = None

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @field_validator("messages")
    @classmethod
    def _some_text(cls, value):
        if not value:
            raise ValueError("messages is empty")
        if not any(message.content.strip() for message in value):
            raise ValueError("every message is empty")
        return value

    def prompt_ids(self, target: LoadedModel) -> torch.Tensor:
        return encode_messages(target, [message.model_dump(exclude_none=True) for message in self.messages])

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def _parse(request_model: type[GenerationRequest], raw: bytes) -> GenerationRequest:
    """The request in ``raw``, or a 400 naming the first field at fault."""
    try:
        data = json.loads(raw)
    except ValueError as error:  # also bytes that are not UTF-8
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        request = request_model.model_validate(data, strict=True)
    except ValidationError as error:
        problems = [(".".join(str(part) for part in item["loc"]) or "body", item["msg"].removeprefix("Value error, "))
                    for item in error.errors()]
        raise ApiError(400, "; ".join(f"{where}: {message}" for where, message in problems), problems[0][0]) from None
    _check_unicode(data, "")  # after validation, which leaves only the request's few known levels of nesting
    return request


def _check_unicode(value, where: str) -> None:
    """Refuse strings that are not valid Unicode: JSON may carry a lone surrogate (``"\\ud800"``),
    which no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ApiError(400, f"{where or 'body'}: not valid Unicode text (a lone surrogate at character "
                           f"{error.start})", where or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, f"{where}.{index}")


def prepare(engine: Engine, request_model: type[GenerationRequest], raw: bytes,
            loop: asyncio.AbstractEventLoop) -> tuple[GenerationRequest, Job]:
    """The request in ``raw`` and its job: parsed, validated, tokenised and checked against the
    model's context. CPU work (a large prompt takes seconds): run it off the event loop."""
    body = _parse(request_model, raw)
    if body.model is not None and body.model != engine.model_name:
        raise ApiError(404, f"model '{body.model}' is not served here; this server serves '{engine.model_name}'",
                       "model", kind="not_found_error")
    method = body.method or engine.default_method
    try:
        check_method_name(method)
    except TierspecError as error:
        raise ApiError(400, str(error), "method") from None
    try:
        sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
    except TierspecError as error:
        raise ApiError(400, str(error)) from None
    try:
        prompt_ids = body.prompt_ids(engine.target)
    except TierspecError as error:
        raise ApiError(400, str(error), body.prompt_param) from None
    room = None if engine.context is None else engine.context - len(prompt_ids)
    if room is not None and room < 1:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context is {engine.context}",
                       body.prompt_param)
    max_tokens = body.requested_tokens() or body.default_max_tokens or room
    if max_tokens is None:
        raise ApiError(400, "give max_tokens: the model's context length is unknown", "max_tokens")
    if room is not None and max_tokens > room:
        raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {len(prompt_ids)} tokens exceed the model's "
                       f"context of {engine.context}", "max_tokens")
    config = DecodeConfig(max_new_tokens=max_tokens, sampling=sampling, eos_token_ids=engine.eos)
    return body, Job(prompt_ids, method, body.num_draft, config, body.seed, body.stop or [], loop)
