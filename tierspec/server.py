"""An OpenAI-compatible HTTP server: ``tierspec serve``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (the
model's chat template applied), ``GET /health``. ``stream: true`` answers with server-sent
events in OpenAI's chunk format. Beside OpenAI's fields a request may carry ``method`` (any
tierspec method, overriding the one chosen at start-up), ``top_k`` and ``num_draft``; the
``usage`` object carries the speculative statistics next to the token counts.

One loaded model serves one generation at a time: a single worker thread takes requests in
arrival order from a bounded queue. A request that finds the queue full is answered 503 with
``Retry-After`` at once; a client that disconnects stops its generation at the next cycle.
Errors use OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Iterator, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from .api import TextStream
from .decode import DecodeConfig, GenerationStats, decode
from .errors import TierspecError
from .methods import Method, MethodOptions, build_method, check_method_name, default_method
from .models import LoadedModel
from .prompting import encode_messages, encode_prompt, eos_ids
from .sampling import SamplingConfig

# ---- errors ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def _error_response(error: ApiError) -> JSONResponse:
    body = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


# ---- requests ----------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints. Unknown fields are refused (a typo must not be ignored)."""

    model_config = ConfigDict(extra="forbid", strict=False)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")
    user: str | None = None
    # tierspec's own fields
    method: str | None = None
    top_k: int = Field(default=0, ge=0)
    num_draft: int | None = Field(default=None, ge=0)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("give one prompt per request")
            value = value[0]
        if not value.strip():
            raise ValueError("the prompt is empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(_Common):
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


# ---- the engine: one model, one generation at a time ---------------------------------------------


@dataclass
class Job:
    """One request's generation: what the worker needs, and the channel back to the handler."""

    prompt_ids: object
    method: str
    config: DecodeConfig
    num_draft: int | None
    seed: int | None
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def send(self, *event) -> None:
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


class Engine:
    """Runs generations one at a time on one loaded model.

    Admission is counted here (running + waiting ≤ 1 + ``max_queue``) so that a full server
    answers at once instead of piling up requests. Built methods are kept per (name,
    num_draft); a policy starts afresh for every request, so a seed gives the same text
    whatever the server ran before.
    """

    def __init__(self, target: LoadedModel, method: str | None = None, drafter: LoadedModel | None = None,
                 options: MethodOptions = MethodOptions(), max_queue: int = 8):
        """``method``: requests' default (None: ``methods.default_method(target)``)."""
        method = method or default_method(target, options)
        check_method_name(method)
        if target.tokenizer is None:
            raise TierspecError(f"model '{target.identity.name}' has no tokenizer: the server speaks text")
        if max_queue < 0:
            raise TierspecError(f"max_queue must be >= 0, got {max_queue}")
        self.target, self.default_method, self.drafter, self.options = target, method, drafter, options
        self.max_queue = max_queue
        self.eos = eos_ids(target)
        self.context = getattr(target.model.config, "max_position_embeddings", None)
        self._methods: dict[tuple[str, int | None], Method] = {}
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierspec-generate")
        self._lock = threading.Lock()
        self._admitted = 0
        self._running: Job | None = None
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}

    # admission
    def try_admit(self) -> bool:
        with self._lock:
            if self._admitted >= 1 + self.max_queue:
                self.counts["refused"] += 1
                return False
            self._admitted += 1
            return True

    def _release(self, outcome: str) -> None:
        with self._lock:
            self._admitted -= 1
            self.counts[outcome] += 1

    def health(self) -> dict:
        with self._lock:
            return {"status": "ok", "model": self.target.identity.name, "method": self.default_method,
                    "running": int(self._running is not None), "waiting": max(self._admitted - 1, 0),
                    "max_queue": self.max_queue, **self.counts}

    def method(self, name: str, num_draft: int | None) -> Method:
        key = (name, num_draft)
        if key not in self._methods:
            options = self.options if num_draft is None else replace(self.options, num_draft=num_draft)
            self._methods[key] = build_method(name, self.target, self.drafter, options)
        return self._methods[key]

    def submit(self, job: Job) -> None:
        self._worker.submit(self._run, job)

    def _run(self, job: Job) -> None:
        """The worker: build the method, generate, send ("started"), ("text", s)…, ("done", …)."""
        outcome = "failed"
        try:
            if job.cancel.is_set():  # the client left while waiting
                outcome = "cancelled"
                return
            with self._lock:
                self._running = job
            try:
                method = self.method(job.method, job.num_draft)
            except TierspecError as error:
                job.send("error", ApiError(400, str(error), "method"))
                return
            job.send("started")
            outcome = self._generate(job, method)
        except Exception as error:  # a bug: the handler answers 500, the log keeps the traceback, the worker goes on
            logging.getLogger("tierspec.server").exception("generation failed")
            job.send("error", ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error"))
        finally:
            with self._lock:
                self._running = None
            self._release(outcome)

    def _generate(self, job: Job, method: Method) -> str:
        """One generation through ``api.TextStream`` (the library's own loop over the decode
        steps, with its incremental detokeniser and statistics), cut at stop sequences and
        stopped at the next cycle when the client has left."""
        import torch

        generator = torch.Generator().manual_seed(job.seed) if job.seed is not None else None
        text_stream = TextStream(decode(self.target, method, job.prompt_ids, job.config, generator), self.target)
        stops = StopMatcher(job.stops)
        finish = None
        try:
            for piece in text_stream:
                text, stopped = stops.feed(piece)
                if text:
                    job.send("text", text)
                if stopped:
                    finish = "stop"
                    break
                if job.cancel.is_set():
                    return "cancelled"
            else:
                tail = stops.flush()
                if tail:
                    job.send("text", tail)
        finally:
            text_stream.close()
        token_ids = text_stream.token_ids
        if finish is None:
            finish = "stop" if token_ids and token_ids[-1] in self.eos else "length"
        job.send("done", finish, text_stream.stats, len(token_ids), job.method)
        return "completed"

    def shutdown(self) -> None:
        """Stop the running generation at its next cycle and refuse the waiting ones."""
        with self._lock:
            if self._running is not None:
                self._running.cancel.set()
        self._worker.shutdown(wait=True, cancel_futures=True)


# ---- the app -------------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, stats: GenerationStats, method: str) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "method": method,
        "drafted_tokens": stats.drafted,
        "accepted_tokens": stats.accepted,
        "mean_accepted_tokens": round(stats.mean_accepted_tokens, 4),  # τ: tokens per target call
        "target_calls": stats.target_calls,
        "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position()],
        "seconds": round(stats.wall_seconds, 4),
    }


def create_app(engine: Engine) -> FastAPI:
    """The FastAPI application serving ``engine`` (uvicorn runs it: ``serve``)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()
        counts = engine.health()
        print(f"tierspec serve: stopped cleanly ({counts['completed']} completed, {counts['cancelled']} cancelled, "
              f"{counts['failed']} failed, {counts['refused']} refused)", file=sys.stderr, flush=True)

    app = FastAPI(title="tierspec", lifespan=lifespan)
    model_name = engine.target.identity.name

    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):
        return _error_response(error)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        message = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', ())[1:]) or 'body'}: {item.get('msg')}" for item in error.errors()
        )
        return _error_response(ApiError(400, message or "invalid request", where))

    @app.get("/health")
    async def health():
        return engine.health()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "tierspec"}]}

    def prepare(body: _Common, prompt_ids, max_tokens: int | None, loop) -> Job:
        method = body.method or engine.default_method
        try:
            check_method_name(method)
        except TierspecError as error:
            raise ApiError(400, str(error), "method") from None
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"model '{body.model}' is not served here; this server serves '{model_name}'",
                           "model", kind="not_found_error")
        room = None if engine.context is None else engine.context - len(prompt_ids)
        if room is not None and room < 1:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; the model's context is {engine.context}",
                           "messages" if isinstance(body, ChatRequest) else "prompt")
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionRequest) else room
        if room is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {len(prompt_ids)} tokens exceed the model's "
                           f"context of {engine.context}", "max_tokens")
        try:
            sampling = SamplingConfig(body.temperature, body.top_k, body.top_p)
        except TierspecError as error:
            raise ApiError(400, str(error)) from None
        config = DecodeConfig(max_new_tokens=max_tokens, sampling=sampling, eos_token_ids=engine.eos)
        return Job(prompt_ids, method, config, body.num_draft, body.seed, body.stop or [], loop)

    async def next_event(job: Job, request: Request):
        """The job's next event; a client gone while it waits cancels the job."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.25)
            except TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    raise ApiError(499, "client disconnected") from None

    async def run(request: Request, body: _Common, prompt_ids, max_tokens, kind: str):
        job = prepare(body, prompt_ids, max_tokens, asyncio.get_running_loop())
        if not engine.try_admit():
            raise ApiError(503, f"the server is busy ({engine.max_queue} requests already waiting); retry shortly",
                           kind="server_busy", headers={"Retry-After": "1"})
        engine.submit(job)
        event = await next_event(job, request)
        if event[0] == "error":
            raise event[1]
        created, ident = int(time.time()), f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            return StreamingResponse(stream_events(job, request, kind, ident, created, len(prompt_ids), body),
                                     media_type="text/event-stream")
        pieces = []
        while True:
            event = await next_event(job, request)
            if event[0] == "text":
                pieces.append(event[1])
            elif event[0] == "error":
                raise event[1]
            else:
                _, finish, stats, completion_tokens, method = event
                break
        text = "".join(pieces)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                  if kind == "chat" else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish})
        return {"id": ident, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
                "model": model_name, "choices": [choice],
                "usage": _usage(len(prompt_ids), completion_tokens, stats, method)}

    async def stream_events(job: Job, request: Request, kind: str, ident: str, created: int, prompt_tokens: int,
                            body: _Common):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(delta: dict | None = None, text: str | None = None, finish=None, usage=None) -> str:
            if kind == "chat":
                choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
            else:
                choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
            payload = {"id": ident, "object": obj, "created": created, "model": model_name, "choices": choices}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        finished = False
        try:
            if kind == "chat":
                yield chunk(delta={"role": "assistant", "content": ""})
            while True:
                event = await next_event(job, request)
                if event[0] == "text":
                    yield chunk(delta={"content": event[1]}, text=event[1])
                elif event[0] == "error":
                    error = event[1]
                    body_ = {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}
                    yield f"data: {json.dumps(body_)}\n\n"
                    break
                else:
                    _, finish, stats, completion_tokens, method = event
                    yield chunk(delta={}, text="", finish=finish)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield chunk(usage=_usage(prompt_tokens, completion_tokens, stats, method))
                    break
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away (the response task was cancelled)
                job.cancel.set()

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        try:
            prompt_ids = encode_prompt(engine.target, body.prompt, chat_template=False)
        except TierspecError as error:
            raise ApiError(400, str(error), "prompt") from None
        return await run(request, body, prompt_ids, body.max_tokens, "text")

    @app.post("/v1/chat/completions")
    async def chat(request: Request, body: ChatRequest):
        try:
            prompt_ids = encode_messages(engine.target, [m.model_dump(exclude_none=True) for m in body.messages])
        except TierspecError as error:
            raise ApiError(400, str(error), "messages") from None
        return await run(request, body, prompt_ids, body.max_completion_tokens or body.max_tokens, "chat")

    return app


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run the server until SIGINT/SIGTERM: uvicorn stops accepting, open responses get a few
    seconds, the running generation is stopped at its next cycle, a line on stderr says so, and
    the process then ends by the signal it received (uvicorn re-raises it: exit status 128 + n,
    as a process stopped by that signal conventionally reports)."""
    import uvicorn

    uvicorn.run(create_app(engine), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


@contextlib.contextmanager
def serving_in_background(engine: Engine, host: str = "127.0.0.1", log_level: str = "warning",
                          start_timeout: float = 30.0) -> Iterator[int]:
    """Serve ``engine`` from a background thread of this process on a free port of ``host``
    (tests, the load benchmark); yields the port and stops the server on exit."""
    import socket

    import uvicorn

    with socket.socket() as sock:
        sock.bind((host, 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine), host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
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
        thread.join(timeout=30)
