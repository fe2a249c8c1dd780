"""A request body → a job for the scheduler: strict request models (a wrong type is refused, never
coerced; unknown fields are refused), JSON parsing, tokenisation and the context check. All of
it is CPU work: the handlers run ``prepare`` on a thread, off the event loop."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..api import SEED_RANGE
from ..decode import MAX_TOP_LOGPROBS, DecodeConfig
from ..errors import TierspecError
from ..limits import MAX_LOGIT_BIAS_ENTRIES, MAX_NUM_DRAFT
from ..methods import check_method_name
from ..models import LoadedModel
from ..modifiers import BIAS_RANGE, PENALTY_RANGE, LogitModifiers
from ..prompting import encode_messages, encode_prompt
from ..sampling import SamplingConfig
from ..structured import ToolChoice, ToolConfig, with_tools
from .scheduler import ApiError, Choice, Job, Scheduler
from .structured import structured_request

#: Most choices one request may ask for (prompts × ``n``): each is a generation of its own.
MAX_CHOICES = 128
#: A request without tools.
NO_TOOLS = ToolConfig((), ToolChoice("none"))


#: a logit_bias key: a token id in ASCII digits
TOKEN_ID = re.compile(r"[0-9]{1,10}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by both endpoints. Strict: a wrong type is an error, never coerced
    (``"max_tokens": "5"`` and ``"stream": "yes"`` are refused); unknown fields are refused
    (a typo must not be ignored). ``store`` is accepted (nothing is stored). ``response_format``,
    ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are kept as their JSON and checked and
    compiled in ``prepare`` (``server.structured.structured_request``: a 400 naming the field)."""

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
    n: int = Field(default=1, ge=1, le=16)
    user: str | None = None
    presence_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1], allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # tierspec's own fields
    method: str | None = None
    top_k: int = Field(default=0, ge=0)  # at most the vocabulary: checked in ``prepare``
    num_draft: int | None = Field(default=None, ge=0, le=MAX_NUM_DRAFT)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """``null`` for a field whose default is a value means that default, as OpenAI's API reads it
        (clients serialise unset options as null: ``"temperature": null`` was a 400)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {key: value for key, value in data.items()
                    if not (value is None and key in fields and fields[key].default is not None
                            and not fields[key].is_required())}
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}")
        for key, bias in (value or {}).items():
            # ASCII digits only: str.isdigit took "²" (int() then raised: a 500) and read "٣" as 3
            if not TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys are token ids (strings of at most 10 digits 0-9), got '{key[:40]}'")
            if not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
                raise ValueError(f"the bias of token {key} must be in [{BIAS_RANGE[0]:g}, {BIAS_RANGE[1]:g}], got {bias}")
        return value

    @field_validator("method")
    @classmethod
    def _a_method_name(cls, value):
        if value is not None and not value.strip():
            raise ValueError("give a method name, or leave the field out for the server's default")
        return value

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

    def prompts_ids(self, target: LoadedModel, tools: ToolConfig = NO_TOOLS) -> list[torch.Tensor]:
        """Each prompt's token ids [n] (the completions endpoint takes several); ``tools``: the
        request's tools (a chat shows them to the model)."""
        raise NotImplementedError

    def structured_fields(self) -> dict:
        """The fields that constrain the reply's form, as their JSON (None: not given)."""
        return {"response_format": self.response_format, "tools": self.tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls}

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        """None: no logprobs; else the number of alternatives per token."""
        return None

    def modifiers(self, vocab_size: int) -> LogitModifiers:
        bias = tuple((int(token), float(value)) for token, value in (self.logit_bias or {}).items())
        for token, _ in bias:
            if token >= vocab_size:
                raise ApiError(400, f"logit_bias: token id {token} is outside the model's vocabulary "
                               f"(0 .. {vocab_size - 1})", "logit_bias")
        return LogitModifiers(self.presence_penalty, self.frequency_penalty, bias)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``prompt``: text, token ids, or a list of either (one choice per prompt and ``n``).
    ``logprobs`` (0 .. 20 alternatives) and ``echo`` (the prompt again in front of the text, its
    tokens scored by the prefill; with ``max_tokens: 0`` only that)."""

    prompt_param = "prompt"
    default_max_tokens = 16  # OpenAI's default for completions

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value):
        if value == []:
            raise ValueError("give at least one prompt")
        prompts = value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]
        for i, prompt in enumerate(prompts):
            where = f"prompt {i}" if len(prompts) > 1 else "the prompt"
            if isinstance(prompt, str) and not prompt.strip():
                raise ValueError(f"{where} is empty")
            if isinstance(prompt, list) and (not prompt or any(token < 0 for token in prompt)):
                raise ValueError(f"{where}: give one or more token ids >= 0")
        return value

    def prompts(self) -> list[str | list[int]]:
        value = self.prompt
        return value if isinstance(value, list) and value and not isinstance(value[0], int) else [value]

    def prompts_ids(self, target: LoadedModel, tools: ToolConfig = NO_TOOLS) -> list[torch.Tensor]:
        ids = []
        for i, prompt in enumerate(self.prompts()):
            if isinstance(prompt, list):
                bad = [token for token in prompt if token >= target.vocab_size]
                if bad:
                    raise ApiError(400, f"prompt {i}: token id {bad[0]} is outside the model's vocabulary "
                                   f"(0 .. {target.vocab_size - 1})", "prompt")
                ids.append(torch.tensor(prompt, dtype=torch.long))
            else:
                ids.append(encode_prompt(target, prompt, chat_template=False))
        return ids

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return self.logprobs


def _content_text(value):
    """A message's content: a string, or a list of text parts (``[{"type": "text", "text": ...}]``,
    joined with newlines); any other part type is refused, by name."""
    if not isinstance(value, list):
        return value
    texts = []
    for i, part in enumerate(value):
        if not isinstance(part, dict):
            raise ValueError(f"part {i} must be an object such as {{\"type\": \"text\", \"text\": \"...\"}}")
        kind = part.get("type")
        if kind != "text":
            raise ValueError(f"part {i} has type {kind!r}: only text parts are supported (this model reads text)")
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: a text part is {{\"type\": \"text\", \"text\": a string}}")
        texts.append(part["text"])
    if not texts:
        raise ValueError("the list of content parts is empty")
    return "\n".join(texts)


class FunctionCall(BaseModel):
    """A call's function: its name and ``arguments``, JSON text of an object (OpenAI's form)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value):
        try:
            parsed = json.loads(value)
        except ValueError as error:
            raise ValueError(f"arguments must be JSON text of an object: {error}") from None
        except RecursionError:
            raise ValueError("arguments must be JSON text of an object: nested too deeply") from None
        if not isinstance(parsed, dict):
            raise ValueError("arguments must be JSON text of an object")
        return value


class ToolCallRecord(BaseModel):
    """One call of an earlier assistant turn, as the history sends it back (OpenAI's
    ``message.tool_calls`` item)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message; ``developer`` (OpenAI's newer name for the system role) is the template's
    ``system`` role. An assistant message may carry the ``tool_calls`` it made (its content then
    optional), a ``tool`` message answers one (``tool_call_id``); ``structured.with_tools``
    renders both as text the chat template shows."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCallRecord] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value):
        return _content_text(value)

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to an assistant message, not a {self.role} message")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id, the id of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to a tool message, not a {self.role} message")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def for_template(self) -> dict:
        """The message as ``structured.with_tools`` takes it: role (developer → system), content,
        name, and an assistant's ``tool_calls`` in OpenAI's form."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        return message


class ChatRequest(GenerationRequest):
    prompt_param = "messages"
    default_max_tokens = None

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @field_validator("messages")
    @classmethod
    def _some_text(cls, value):
        if not value:
            raise ValueError("messages is empty")
        if not any((message.content or "").strip() or message.tool_calls for message in value):
            raise ValueError("every message is empty")
        return value

    def prompts_ids(self, target: LoadedModel, tools: ToolConfig = NO_TOOLS) -> list[torch.Tensor]:
        """The conversation through the chat template, the tools described in its system message
        and earlier calls and their results as text (``structured.with_tools``)."""
        return [encode_messages(target, with_tools([message.for_template() for message in self.messages], tools))]

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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


def check_model(model: str | None, served: str) -> None:
    """A request that names a model names the one served here (404 otherwise, as OpenAI's)."""
    if model is not None and model != served:
        raise ApiError(404, f"model '{model}' is not served here; this server serves '{served}'", "model",
                       kind="not_found_error")


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


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request with ``seed`` (``n`` > 1: independent samples):
    choice 0 keeps the request's seed, so ``n: 1`` and the first of ``n`` choices give the same
    text; the others take a hash of (seed, index) in int64's range."""
    if index == 0 or seed is None:
        return seed
    digest = hashlib.blake2b(f"{seed}/choice/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prepare(engine: Scheduler, request_model: type[GenerationRequest], raw: bytes,
            loop: asyncio.AbstractEventLoop) -> tuple[GenerationRequest, Job]:
    """The request in ``raw`` and its job: parsed, validated, tokenised and checked against the
    model's context. CPU work (a large prompt takes seconds): run it off the event loop."""
    body = _parse(request_model, raw)
    if body.stream_options is not None and not body.stream:  # OpenAI's answer, word for word
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    if body.top_k > engine.target.vocab_size:
        raise ApiError(400, f"top_k: at most the vocabulary size {engine.target.vocab_size} (0: no top-k), got "
                       f"{body.top_k}", "top_k")
    check_model(body.model, engine.model_name)
    if isinstance(body, CompletionRequest) and body.max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens: 0 generates nothing; it is allowed with echo (score the prompt) only",
                       "max_tokens")
    method = engine.default_method if body.method is None else body.method
    try:
        check_method_name(method)
    except TierspecError as error:
        raise ApiError(400, str(error), "method") from None
    try:
        sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
    except TierspecError as error:
        raise ApiError(400, str(error)) from None
    modifiers = body.modifiers(engine.target.vocab_size)
    # response_format and tools: checked and compiled to the grammar every choice starts a state of
    structured = structured_request(body.structured_fields(), engine.target.tokenizer, engine.target.vocab_size,
                                    engine.eos, chat=isinstance(body, ChatRequest))
    try:
        prompts = body.prompts_ids(engine.target, structured.tools)
    except TierspecError as error:
        raise ApiError(400, str(error), body.prompt_param) from None
    if len(prompts) * body.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts × n {body.n} = {len(prompts) * body.n} choices; at most "
                       f"{MAX_CHOICES} per request", "n")
    requested = body.requested_tokens()
    logprobs = body.logprobs_count()
    score_prompt = getattr(body, "echo", False) and logprobs is not None  # echo without logprobs: the text only
    choices = []
    seed = body.seed
    if seed is None and body.n > 1:  # independent samples still: one fresh seed, one derived per choice
        seed = int(torch.randint(SEED_RANGE[0], SEED_RANGE[1], (1,)))
    for p, prompt_ids in enumerate(prompts):
        where = body.prompt_param if len(prompts) == 1 else f"{body.prompt_param} {p}"
        room = None if engine.context is None else engine.context - len(prompt_ids)
        if room is not None and room < 1:
            raise ApiError(400, f"{where} has {len(prompt_ids)} tokens; the model's context is {engine.context}",
                           body.prompt_param)
        max_tokens = requested if requested is not None else (body.default_max_tokens or room)
        if max_tokens is None:
            raise ApiError(400, "give max_tokens: the model's context length is unknown", "max_tokens")
        if room is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the {len(prompt_ids)} tokens of {where} exceed the "
                           f"model's context of {engine.context}", "max_tokens")
        try:
            config = DecodeConfig(max_new_tokens=max(1, max_tokens), sampling=sampling, eos_token_ids=engine.eos,
                                  modifiers=modifiers, logprobs=logprobs, score_prompt=score_prompt,
                                  num_draft=body.num_draft, constraint=structured.grammar)
        except TierspecError as error:
            raise ApiError(400, str(error), "num_draft" if "num_draft" in str(error) else None) from None
        echo_text = None
        if getattr(body, "echo", False):
            prompt = body.prompts()[p]
            echo_text = prompt if isinstance(prompt, str) else engine.target.tokenizer.decode(prompt)
        for i in range(body.n):
            choices.append(Choice(p * body.n + i, p, prompt_ids, choice_seed(seed, i), config,
                                  score_only=max_tokens == 0, echo_text=echo_text))
    return body, Job(choices, method, body.stop or [], loop, tools=structured.tools if structured.tools.active else None,
                     stream=bool(body.stream))
