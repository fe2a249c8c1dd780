"""The HTTP side of ``tierspec serve``: module-level handlers over the ``Engine`` (kept on the
application's state), one response format per endpoint, and running the server under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..errors import TierspecError
from .engine import CLIENT_LEFT, ApiError, Engine, Failed, Finished, Job, TextPiece, shutting_down
from .parsing import ChatRequest, CompletionRequest, GenerationRequest, prepare

#: Bodies above this many bytes get 413 (``--max-request-bytes``). A prompt filling a whole
#: 8192-token context is about 40 KB of English; JSON escapes of other scripts take up to 12
#: bytes per character.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
#: Requests parsed and tokenised at once: each holds its body, parse tree and token ids in
#: memory meanwhile, so many large requests together are bounded by this, not by their number.
PREPARING_AT_ONCE = 2


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


COMPLETIONS, CHAT_COMPLETIONS = Completions(), ChatCompletions()


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
    return await _answer(request, COMPLETIONS)


async def chat_completions(request: Request):
    return await _answer(request, CHAT_COMPLETIONS)


async def _answer(request: Request, endpoint: Endpoint):
    """Prepare the request off the event loop, queue it, and answer in ``endpoint``'s format:
    one JSON response, or server-sent events once the generation has started (until then an
    error still gets its own status)."""
    engine = _engine(request)
    raw = await _read_body(request, request.app.state.max_request_bytes)
    async with request.app.state.preparing:
        body, job = await run_in_threadpool(prepare, engine, endpoint.request_model, raw, asyncio.get_running_loop())
    engine.submit(job)
    reply = Reply(endpoint, engine.model_name, len(job.prompt_ids), body.include_usage)
    async with _cancelled_if_the_client_leaves(request, engine, job):
        event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        if not body.stream:
            return JSONResponse(await _whole(job, reply))
    return StreamingResponse(_chunks(job, engine, reply), media_type="text/event-stream")


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes ``limit`` bytes (declared or counted as it
    arrives): a huge body is never held in memory. (uvicorn reads and drops the rest of a
    refused body, for its keep-alive timeout at most, so the client gets to read the 413.)"""
    too_large = ApiError(413, f"the request body exceeds the server's limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected") from None
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
                    raise shutting_down()
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


def _json_error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return _json_error(error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return _json_error(ApiError(error.status_code, message, kind=kind, headers=error.headers))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    return _json_error(ApiError(500, f"internal error: {type(error).__name__}", kind="server_error"))


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
    app.state.preparing = asyncio.Semaphore(PREPARING_AT_ONCE)
    return app


# ---- running it ----------------------------------------------------------------------------------------


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` (IPv6 when the host has a colon, as uvicorn decides),
    or a one-line error: a port in use, an unknown host. It listens at once, so the port is held
    while the model loads; connections made meanwhile wait in the backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen()
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

    def __init__(self, engine: Engine, log_level: str, max_request_bytes: int):
        # The graceful-shutdown timeout is a backstop only: the engine ends every request within a cycle.
        super().__init__(uvicorn.Config(create_app(engine, max_request_bytes), log_level=log_level, lifespan="off",
                                        timeout_graceful_shutdown=30))
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


def serve(engine: Engine, sock: socket.socket, log_level: str = "info",
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
    """Serve ``engine`` on ``sock`` (from ``listen``) until SIGINT or SIGTERM; then every open
    request gets a well-formed ending (see the module's docstring), a line on stderr says how
    the server stopped and what became of its requests, and this returns."""
    server = _Server(engine, log_level, max_request_bytes)
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
    server = _Server(engine, log_level, max_request_bytes)
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
