"""An OpenAI-compatible HTTP server: ``tierspec serve``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
model's chat template applied), ``GET /health``. ``stream: true`` answers with server-sent
events in OpenAI's chunk format. Beside OpenAI's fields a request may carry ``method`` (any
tierspec method, overriding the one chosen at start-up), ``top_k`` and ``num_draft``; the
``usage`` object carries the speculative statistics next to the token counts.

How a request flows:

    handler (event loop)          read the body (≤ max_request_bytes, else 413)
      → prepare (a thread)        parse JSON, validate strictly, tokenise, check the context
      → Engine.submit             queue it, or 503 when the queue is full
      → Engine's worker thread    one generation at a time; sends typed events back:
                                  Started, TextPiece…, Finished | Failed
      → the endpoint's format     one JSON response, or one SSE chunk per event

A client that leaves cancels its request: a waiting one leaves the queue at once, a running
one stops at its next cycle. On shutdown (SIGTERM, SIGINT) the server stops accepting, turns
waiting requests away with 503 and stops the running one at its next cycle with a
well-formed ending. Every error answers with OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import ClassVar, Iterator, Literal

import torch
import uvicorn
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .api import SEED_RANGE, stream_method
from .decode import DecodeConfig, GenerationStats
from .errors import TierspecError
from .methods import Method, MethodOptions, build_method, check_method_name, default_method
from .models import LoadedModel
from .prompting import encode_messages, encode_prompt, eos_ids
from .sampling import SamplingConfig

#: Bodies above this many bytes get 413 (``--max-request-bytes``). A prompt filling a whole
#: 8192-token context is about 40 KB of English; JSON escapes of other scripts take up to 12
#: bytes per character.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20

log = logging.getLogger("tierspec.server")


# ---- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or after it restarts",
                    kind="server_shutting_down")


# ---- requests: strict types, unknown fields refused ---------------------------------------------------


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
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check_unicode(data, "")
    try:
        return request_model.model_validate(data, strict=True)
    except ValidationError as error:
        problems = [(".".join(str(part) for part in item["loc"]) or "body", item["msg"].removeprefix("Value error, "))
                    for item in error.errors()]
        raise ApiError(400, "; ".join(f"{where}: {message}" for where, message in problems), problems[0][0]) from None


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


# ---- events: what the worker tells a request's handler ---------------------------------------------


@dataclass(frozen=True)
class Started:
    """The method is built and the generation begins (errors before this are the request's)."""


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    stats: GenerationStats
    completion_tokens: int
    method: str
    interrupted: bool = False  # stopped early by a shutdown


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | TextPiece | Finished | Failed

# Why a job was cancelled.
CLIENT_LEFT, SHUTDOWN = "client left", "shutdown"


@dataclass(eq=False)
class Job:
    """One request's generation: what the worker needs, and the channel back to its handler."""

    prompt_ids: torch.Tensor  # [n]
    method: str
    num_draft: int | None
    config: DecodeConfig
    seed: int | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled_by: str | None = None  # CLIENT_LEFT or SHUTDOWN; set once, under the engine's lock

    def send(self, event: Event) -> None:
        """Deliver ``event`` to the handler (from any thread)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class StopMatcher:
    """Cuts streamed text at the first stop sequence, holding back a tail that might begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop sequence was reached)."""
        text = self.pending + piece
        hits = [index for index in (text.find(stop) for stop in self.stops) if index >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        hold = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:size]):
                    hold = size
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


# ---- the engine: one model, one generation at a time ---------------------------------------------


class Engine:
    """Runs generations one at a time on one loaded model, from a bounded queue.

    Admission is decided here (running + waiting ≤ 1 + ``max_queue``) so that a full server
    answers at once instead of piling requests up. Built methods are kept for the last
    ``max_methods`` (name, num_draft) pairs a request asked for: a client sending ever new
    values cannot grow the server's memory, and what a method shares with others (the model,
    the draft head, the forward-cost table) is built once whatever the value.
    """

    def __init__(self, target: LoadedModel, method: str | None = None, drafter: LoadedModel | None = None,
                 options: MethodOptions = MethodOptions(), max_queue: int = 8, max_methods: int = 4):
        """``method``: requests' default (None: ``methods.default_method(target)``)."""
        method = method or default_method(target, options)
        check_method_name(method)
        if target.tokenizer is None:
            raise TierspecError(f"model '{target.identity.name}' has no tokenizer: the server speaks text")
        if max_queue < 0:
            raise TierspecError(f"max_queue must be >= 0, got {max_queue}")
        if max_methods < 1:
            raise TierspecError(f"max_methods must be >= 1, got {max_methods}")
        self.target, self.default_method, self.drafter, self.options = target, method, drafter, options
        self.model_name = target.identity.name
        self.max_queue, self.max_methods = max_queue, max_methods
        self.eos = eos_ids(target)
        self.context = getattr(target.model.config, "max_position_embeddings", None)
        self._methods: OrderedDict[tuple[str, int | None], Method] = OrderedDict()  # least recently used first
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierspec-generate")
        self._lock = threading.Lock()  # guards the fields below
        self._waiting: list[Job] = []
        self._running: Job | None = None
        self._stopping = False
        self.counts = {"completed": 0, "cancelled": 0, "withdrawn": 0, "interrupted": 0, "failed": 0, "refused": 0}

    def health(self) -> dict:
        """Status and counts: ``cancelled`` / ``withdrawn``: the client left during / before its
        generation; ``interrupted``: stopped or turned away by a shutdown; ``refused``: queue full."""
        with self._lock:
            return {"status": "stopping" if self._stopping else "ok", "model": self.model_name,
                    "method": self.default_method, "running": int(self._running is not None),
                    "waiting": len(self._waiting), "max_queue": self.max_queue,
                    "methods_cached": len(self._methods), **self.counts}

    def method(self, name: str, num_draft: int | None) -> Method:
        """The built method (on the worker thread, or before serving starts)."""
        key = (name, num_draft)
        method = self._methods.pop(key, None)
        if method is None:
            options = self.options if num_draft is None else replace(self.options, num_draft=num_draft)
            method = build_method(name, self.target, self.drafter, options)
        self._methods[key] = method
        while len(self._methods) > self.max_methods:
            self._methods.popitem(last=False)
        return method

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise the 503 of a full or stopping server."""
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if len(self._waiting) + (self._running is not None) >= 1 + self.max_queue:
                self.counts["refused"] += 1
                raise ApiError(503, f"the server is busy ({self.max_queue} requests already waiting); retry shortly",
                               kind="server_busy", headers={"Retry-After": "1"})
            self._waiting.append(job)
        self._worker.submit(self._run, job)

    def cancel(self, job: Job, reason: str) -> None:
        """End ``job`` for ``reason``: a waiting job leaves the queue at once (the worker skips
        it), the running one stops at its next cycle."""
        with self._lock:
            self._cancel(job, reason)

    def _cancel(self, job: Job, reason: str) -> None:
        if job.cancelled_by is not None:
            return
        job.cancelled_by = reason
        if job in self._waiting:
            self._waiting.remove(job)
            self.counts["withdrawn" if reason == CLIENT_LEFT else "interrupted"] += 1
            if reason == SHUTDOWN:
                job.send(Failed(_shutting_down()))

    def stop(self) -> None:
        """Shut down: refuse new requests, turn the waiting ones away with 503, stop the
        running one at its next cycle (its client still gets a well-formed ending)."""
        with self._lock:
            self._stopping = True
            for job in [*self._waiting, *([self._running] if self._running is not None else [])]:
                self._cancel(job, SHUTDOWN)

    def close(self) -> None:
        """``stop``, then wait for the worker to finish."""
        self.stop()
        self._worker.shutdown(wait=True)

    def _run(self, job: Job) -> None:
        """The worker: build the method, generate, send Started, TextPiece…, Finished (or Failed)."""
        with self._lock:
            if job not in self._waiting:  # withdrawn or turned away while it waited: already answered
                return
            self._waiting.remove(job)
            self._running = job
        outcome = "failed"
        try:
            try:
                method = self.method(job.method, job.num_draft)
            except TierspecError as error:
                job.send(Failed(ApiError(400, str(error), "method")))
                return
            job.send(Started())
            outcome = self._generate(job, method)
        except Exception as error:  # a bug: the handler answers 500, the log keeps the traceback, the worker goes on
            log.exception("generation failed")
            job.send(Failed(ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error")))
        finally:
            with self._lock:
                self._running = None
                self.counts[outcome] += 1

    def _generate(self, job: Job, method: Method) -> str:
        """One generation, cut at stop sequences, stopped at the next cycle once cancelled;
        returns its outcome."""
        text_stream = stream_method(self.target, method, job.prompt_ids, job.config, job.seed)
        stops = StopMatcher(job.stops)
        finish = None
        try:
            for piece in text_stream:
                text, stopped = stops.feed(piece)
                if text:
                    job.send(TextPiece(text))
                if stopped:
                    finish = "stop"
                    break
                if job.cancelled_by is not None:
                    break
        finally:
            text_stream.close()
        if job.cancelled_by == CLIENT_LEFT:
            return "cancelled"
        if finish is None:
            tail = stops.flush()
            if tail:
                job.send(TextPiece(tail))
            token_ids = text_stream.token_ids
            finish = "stop" if token_ids and token_ids[-1] in self.eos else "length"
        interrupted = job.cancelled_by == SHUTDOWN
        job.send(Finished(finish, text_stream.stats, len(text_stream.token_ids), job.method, interrupted))
        return "interrupted" if interrupted else "completed"


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


# ---- responses: one format per endpoint ---------------------------------------------------------------


class Endpoint:
    """What differs between the two generation endpoints: the request model, and the shape of
    a choice in the whole response and in a streamed chunk."""

    request_model: ClassVar[type[GenerationRequest]]
    object: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]

    def choice(self, text: str, finish_reason: str) -> dict:
        raise NotImplementedError

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def opening_choice(self) -> dict | None:
        """The choice of a first chunk sent before any text (None: no such chunk)."""
        return None


class Completions(Endpoint):
    request_model = CompletionRequest
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    chunk_choice = choice


class ChatCompletions(Endpoint):
    request_model = ChatRequest
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, text: str, finish_reason: str) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}

    def chunk_choice(self, text: str, finish_reason: str | None) -> dict:
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish_reason}

    def opening_choice(self) -> dict:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


@dataclass(frozen=True)
class Reply:
    """The answer to one request in its endpoint's format."""

    endpoint: Endpoint
    model: str
    prompt_tokens: int
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:24])  # of the response's id

    @property
    def id(self) -> str:
        return f"{self.endpoint.id_prefix}-{self.suffix}"

    def usage(self, done: Finished) -> dict:
        stats = done.stats
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "total_tokens": self.prompt_tokens + done.completion_tokens,
            "method": done.method,
            "drafted_tokens": stats.drafted,
            "accepted_tokens": stats.accepted,
            "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),  # τ: tokens per target call
            "target_calls": stats.target_calls,
            "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position()],
            "seconds": round(stats.wall_seconds, 4),
        }

    def whole(self, text: str, done: Finished) -> dict:
        return {"id": self.id, "object": self.endpoint.object, "created": self.created, "model": self.model,
                "choices": [self.endpoint.choice(text, done.finish_reason)], "usage": self.usage(done)}

    def chunk(self, choice: dict | None, usage: dict | None = None) -> str:
        payload = {"id": self.id, "object": self.endpoint.chunk_object, "created": self.created, "model": self.model,
                   "choices": [] if choice is None else [choice]}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"


# ---- handlers ------------------------------------------------------------------------------------


def _engine(request: Request) -> Engine:
    return request.app.state.engine


async def health(request: Request) -> JSONResponse:
    return JSONResponse(_engine(request).health())


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [{"id": _engine(request).model_name, "object": "model",
                                                     "created": 0, "owned_by": "tierspec"}]})


async def completions(request: Request):
    return await _generate(request, Completions())


async def chat_completions(request: Request):
    return await _generate(request, ChatCompletions())


async def _generate(request: Request, endpoint: Endpoint):
    engine = _engine(request)
    raw = await _read_body(request, request.app.state.max_request_bytes)
    body, job = await run_in_threadpool(prepare, engine, endpoint.request_model, raw, asyncio.get_running_loop())
    engine.submit(job)
    reply = Reply(endpoint, engine.model_name, len(job.prompt_ids),
                  body.stream_options is not None and body.stream_options.include_usage)
    async with _cancelled_if_the_client_leaves(request, engine, job):
        event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        if not body.stream:
            return JSONResponse(await _whole(job, reply))
    return StreamingResponse(_chunks(job, engine, reply), media_type="text/event-stream")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes ``limit`` bytes (declared or counted as it
    arrives): a huge body is never held in memory."""
    too_large = ApiError(413, f"the request body exceeds the server's limit of {limit} bytes",
                         headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


@contextlib.asynccontextmanager
async def _cancelled_if_the_client_leaves(request: Request, engine: Engine, job: Job):
    """While the handler waits on ``job``, a disconnect cancels it, and a Failed(499) event lets
    the handler return at once (nobody reads its answer)."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        engine.cancel(job, CLIENT_LEFT)
        job.events.put_nowait(Failed(ApiError(499, "the client disconnected")))

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def _whole(job: Job, reply: Reply) -> dict:
    pieces = []
    while True:
        match await job.events.get():
            case TextPiece(text):
                pieces.append(text)
            case Failed(error):
                raise error
            case Finished() as done:
                if done.interrupted:  # a partial text is no answer
                    raise _shutting_down()
                return reply.whole("".join(pieces), done)


async def _chunks(job: Job, engine: Engine, reply: Reply):
    """The server-sent events of a started job, always ending with ``data: [DONE]``; a client
    that goes away (the response task is cancelled) cancels the job."""
    ended = False
    try:
        opening = reply.endpoint.opening_choice()
        if opening is not None:
            yield reply.chunk(opening)
        while not ended:
            match await job.events.get():
                case TextPiece(text):
                    yield reply.chunk(reply.endpoint.chunk_choice(text, None))
                case Failed(error):
                    yield f"data: {json.dumps(error.body())}\n\n"
                    ended = True
                case Finished() as done:
                    yield reply.chunk(reply.endpoint.chunk_choice("", done.finish_reason))
                    if reply.include_usage:
                        yield reply.chunk(None, reply.usage(done))
                    ended = True
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            engine.cancel(job, CLIENT_LEFT)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return error.response()


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return ApiError(error.status_code, message, kind=kind, headers=error.headers).response()


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    return ApiError(500, f"internal error: {type(error).__name__}", kind="server_error").response()


def create_app(engine: Engine, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Starlette:
    """The ASGI application serving ``engine`` (uvicorn runs it: ``serve``)."""
    if max_request_bytes < 1:
        raise TierspecError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.engine, app.state.max_request_bytes = engine, max_request_bytes
    return app


# ---- running it ----------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``, or a one-line error (a port in use, an unknown host)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise TierspecError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise TierspecError(f"port {port} on {host} is in use (another server?); choose another with --port") from None
        raise TierspecError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server around an engine: on shutdown it stops the engine's requests before
    waiting for their connections, and the signal that stopped it is recorded instead of
    re-raised (a server that ended every request well exits 0)."""

    def __init__(self, engine: Engine, config: uvicorn.Config):
        super().__init__(config)
        self.engine = engine
        self.stopped_by: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = signal.Signals(sig).name
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.engine.stop()
        await super().shutdown(sockets)


def _uvicorn_config(engine: Engine, log_level: str, max_request_bytes: int) -> uvicorn.Config:
    # timeout_graceful_shutdown: a backstop only: the engine ends every request within a cycle.
    return uvicorn.Config(create_app(engine, max_request_bytes), log_level=log_level, lifespan="off",
                          timeout_graceful_shutdown=30)


def serve(engine: Engine, sock: socket.socket, log_level: str = "info",
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Serve ``engine`` on ``sock`` (from ``listen``) until SIGINT or SIGTERM; then every open
    request gets a well-formed ending (see the module's docstring), a line on stderr says how
    the server stopped and what became of its requests, and this returns."""
    server = _Server(engine, _uvicorn_config(engine, log_level, max_request_bytes))
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    if server.started:
        counts = engine.health()
        how = f"stopped on {server.stopped_by}" if server.stopped_by else "stopped"
        print(f"tierspec serve: {how}; requests: {counts['completed']} completed, {counts['interrupted']} ended by the "
              f"shutdown, {counts['cancelled']} cancelled and {counts['withdrawn']} withdrawn by their clients, "
              f"{counts['failed']} failed, {counts['refused']} refused (queue full)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def serving_in_background(engine: Engine, host: str = "127.0.0.1", log_level: str = "warning",
                          start_timeout: float = 30.0,
                          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> Iterator[int]:
    """Serve ``engine`` from a background thread of this process on a free port of ``host``
    (tests, the load benchmark); yields the port, and on exit shuts the server down as a
    signal would and closes the engine."""
    sock = listen(host, 0)
    port = sock.getsockname()[1]
    server = _Server(engine, _uvicorn_config(engine, log_level, max_request_bytes))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise TierspecError(f"the server did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        engine.close()
