"""The HTTP side of ``tierspec serve``: module-level handlers over the ``Scheduler`` (kept on the
application's state), one response format per endpoint, and running the server under uvicorn."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import errno
import gc
import json
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import ClassVar, Iterator

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from pydantic import BaseModel, ConfigDict, ValidationError

from ..decode import GenerationStats
from ..errors import TierspecError
from ..structured import CALL_OPEN, ToolConfig, ToolReply, parse_tool_reply
from ..tokenizer import token_bytes
from .scheduler import CLIENT_LEFT, ApiError, ChoiceDone, Failed, Finished, Job, Scheduler, TextPiece, shutting_down
from .parsing import ChatRequest, CompletionRequest, GenerationRequest, check_model, prepare

#: Bodies above this many bytes get 413 (``--max-request-bytes``). A prompt filling a whole
#: 8192-token context is about 40 KB of English; JSON escapes of other scripts take up to 12
#: bytes per character.
DEFAULT_MAX_REQUEST_BYTES = 1 << 20
#: Seconds a request body may take to arrive (``--body-timeout``): a client that sends its headers
#: and then nothing (or a trickle) is answered 408 instead of holding its connection for ever.
DEFAULT_BODY_TIMEOUT = 30.0
#: Requests parsed and tokenised at once: each holds its body, parse tree and token ids in
#: memory meanwhile, so many large requests together are bounded by this, not by their number.
PREPARING_AT_ONCE = 2


# ---- responses: one format per endpoint ---------------------------------------------------------------

#: JSON has no infinity: a token outside top-k / top-p (log-probability −inf) is reported with this
#: value, as vLLM does.
NO_PROBABILITY = -9999.0


def _finite(logprob: float) -> float:
    return logprob if logprob > NO_PROBABILITY else NO_PROBABILITY


class TokenTexts:
    """Each token id's own text (special tokens spelled out) and bytes (``tokenizer.token_bytes``),
    decoded once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def bytes(self, token: int) -> list[int]:
        spelled = self._bytes.get(token)
        if spelled is None:
            spelled = self._bytes[token] = list(token_bytes(self.tokenizer, token, self(token)))
        return spelled


class Endpoint:
    """What differs between the two generation endpoints: the request model, and the shape of
    a choice (with its logprobs) in the whole response and in a streamed chunk."""

    request_model: ClassVar[type[GenerationRequest]]
    object: ClassVar[str]
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None,
               tools: ToolConfig | None = None) -> dict:
        """A choice of the whole response; ``tools``: the request's active tools (a chat reply
        that is a call block is then read back into ``tool_calls``)."""
        raise NotImplementedError

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def opening_choice(self, index: int, tools: bool = False) -> dict | None:
        """The choice of a first chunk sent before any text (None: no such chunk); ``tools``: the
        reply may be tool calls."""
        return None

    def logprobs(self, records, texts: TokenTexts, offset: int) -> dict:
        """The endpoint's logprobs object for ``records`` (``decode.TokenLogprob``; an echoed
        prompt's first token has no logprob) whose text starts ``offset`` characters into the choice."""
        raise NotImplementedError


class Completions(Endpoint):
    request_model = CompletionRequest
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None,
               tools: ToolConfig | None = None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return self.choice(index, text, finish_reason, logprobs)

    def logprobs(self, records, texts: TokenTexts, offset: int) -> dict:
        """OpenAI's legacy format: parallel lists of tokens, their logprobs, the top alternatives
        as {token: logprob} and each token's offset in the choice's text."""
        tokens, values, tops, offsets = [], [], [], []
        # Offsets count the characters the tokens before make: a character split over several tokens
        # (each shown as U+FFFD) is one character, made by the token that completes it.
        characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for record in records:
            if record.logprob is None:  # an echoed prompt's first token: nothing scores it
                value, top = None, None
            else:
                value = _finite(record.logprob)
                top = {texts(alternative): _finite(logprob) for alternative, logprob in record.top}
            tokens.append(texts(record.token))
            values.append(value)
            tops.append(top)
            offsets.append(offset)
            offset += len(characters.decode(bytes(texts.bytes(record.token))))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


class ChatCompletions(Endpoint):
    request_model = ChatRequest
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None,
               tools: ToolConfig | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if tools is not None:
            reply = parse_tool_reply(text, tools)
            message["content"] = reply.content
            if reply.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in reply.tool_calls]
            finish_reason = reply.finish_reason or finish_reason
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def calls_chunk_choice(self, index: int, calls, logprobs: dict | None) -> list[dict]:
        """The chunks' choices of a reply's ``tool_calls`` (``structured.ToolCall``), one per call
        with its whole ``arguments`` (OpenAI streams them in pieces; one piece is a valid stream);
        the first carries the logprobs of the block's tokens."""
        return [{"index": index, "delta": {"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                                            "function": {"name": call.name, "arguments": call.arguments}}]},
                 "logprobs": logprobs if k == 0 else None, "finish_reason": None} for k, call in enumerate(calls)]

    def opening_choice(self, index: int, tools: bool = False) -> dict:
        # With tools the reply may be calls only: no content is promised before it is known.
        delta = {"role": "assistant"} if tools else {"role": "assistant", "content": ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def logprobs(self, records, texts: TokenTexts, offset: int) -> dict:
        """OpenAI's chat format: one entry per token with its UTF-8 bytes and top alternatives."""
        def entry(token: int, logprob: float) -> dict:
            return {"token": texts(token), "logprob": _finite(logprob), "bytes": texts.bytes(token)}

        content = [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top]}
                   for r in records if r.logprob is not None]
        return {"content": content, "refusal": None}


COMPLETIONS, CHAT_COMPLETIONS = Completions(), ChatCompletions()


def _merged_stats(done: Finished) -> GenerationStats:
    """The statistics of every choice of a request added up (usage reports one set)."""
    total = GenerationStats()
    for choice in done.choices:
        stats = choice.stats
        for name in ("drafted", "evaluated", "accepted", "emitted", "target_calls", "slim_calls", "drafter_calls",
                     "cycles", "wall_seconds"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        for name in ("position_drafted", "position_accepted"):
            mine, theirs = getattr(total, name), getattr(stats, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, count in enumerate(theirs):
                mine[i] += count
    return total


@dataclass
class Reply:
    """The answer to one request in its endpoint's format: the choices' texts and logprobs as
    their pieces arrive, the whole response or one chunk at a time."""

    endpoint: Endpoint
    model: str
    prompt_tokens: int
    include_usage: bool
    texts: TokenTexts
    logprobs: bool  # whether the request asked for them
    tools: ToolConfig | None = None  # the request's active tools: replies are read back into tool_calls
    created: int = field(default_factory=lambda: int(time.time()))
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:24])  # of the response's id
    _text: dict[int, str] = field(default_factory=dict)  # choice → its text so far
    _records: dict[int, list] = field(default_factory=dict)  # choice → its logprob records so far

    @property
    def id(self) -> str:
        return f"{self.endpoint.id_prefix}-{self.suffix}"

    def usage(self, done: Finished) -> dict:
        stats = _merged_stats(done)
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

    def add(self, piece: TextPiece) -> dict | None:
        """Take ``piece`` in; returns its logprobs object (None without logprobs)."""
        return self.add_all([piece])

    def add_all(self, pieces: list[TextPiece], formatted: bool = True) -> dict | None:
        """Take ``pieces`` of one choice in, in order; returns one logprobs object for all of
        them (None without logprobs or pieces, or unless ``formatted``: a whole response formats
        every record once, in ``whole``)."""
        if not pieces:
            return None
        index = pieces[0].index
        offset = len(self._text.get(index, ""))
        self._text[index] = self._text.get(index, "") + "".join(piece.text for piece in pieces)
        if not self.logprobs:
            return None
        records = [record for piece in pieces for record in piece.logprobs]
        self._records.setdefault(index, []).extend(records)
        return self.endpoint.logprobs(records, self.texts, offset) if formatted else None

    def whole(self, done: Finished) -> dict:
        choices = []
        for choice in sorted(done.choices, key=lambda c: c.index):
            logprobs = self.endpoint.logprobs(self._records.get(choice.index, []), self.texts, 0) \
                if self.logprobs else None
            choices.append(self.endpoint.choice(choice.index, self._text.get(choice.index, ""),
                                                choice.finish_reason, logprobs, self.tools))
        return {"id": self.id, "object": self.endpoint.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(done)}

    def chunk(self, choice: dict | None, usage: dict | None = None) -> str:
        payload = {"id": self.id, "object": self.endpoint.chunk_object, "created": self.created, "model": self.model,
                   "choices": [] if choice is None else [choice]}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"


# ---- handlers ------------------------------------------------------------------------------------


def _scheduler(request: Request) -> Scheduler:
    return request.app.state.scheduler


async def health(request: Request) -> JSONResponse:
    return JSONResponse(_scheduler(request).health())


def _model_card(scheduler: Scheduler) -> dict:
    return {"id": scheduler.model_name, "object": "model", "created": 0, "owned_by": "tierspec"}


async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(_scheduler(request))]})


async def model(request: Request) -> JSONResponse:
    """``GET /v1/models/{id}`` (``models.retrieve``): the served model, else 404."""
    scheduler, name = _scheduler(request), request.path_params["model"]
    if name != scheduler.model_name:
        raise ApiError(404, f"model '{name}' is not served here; this server serves '{scheduler.model_name}'", "model",
                       kind="not_found_error")
    return JSONResponse(_model_card(scheduler))


async def tokenizer_info(request: Request) -> JSONResponse:
    """``GET /tokenizer_info`` (vLLM's): what a client tokenising through the server needs (lm-eval's
    ``remote`` tokenizer backend finds it and then needs no tokenizer of its own)."""
    scheduler = _scheduler(request)
    tokenizer = scheduler.target.tokenizer
    return JSONResponse({"eos_token": getattr(tokenizer, "eos_token", None),
                         "bos_token": getattr(tokenizer, "bos_token", None),
                         "pad_token": getattr(tokenizer, "pad_token", None),
                         "chat_template": getattr(tokenizer, "chat_template", None),
                         "model_max_length": scheduler.context})


class _TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class _DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def _small_body(raw: bytes, request_model: type[BaseModel]) -> BaseModel:
    try:
        return request_model.model_validate_json(raw, strict=True)
    except ValidationError as error:
        item = error.errors()[0]
        where = ".".join(str(part) for part in item["loc"]) or "body"
        raise ApiError(400, f"{where}: {item['msg']}", where) from None


async def tokenize(request: Request) -> JSONResponse:
    """``POST /tokenize`` (vLLM's): ``{"prompt", "add_special_tokens"}`` → ``{"tokens", "count",
    "max_model_len"}`` with the served model's tokenizer (no chat template)."""
    scheduler = _scheduler(request)
    body = _small_body(await _read_body(request, request.app.state.max_request_bytes, request.app.state.body_timeout),
                       _TokenizeRequest)
    check_model(body.model, scheduler.model_name)
    tokens = (await run_in_threadpool(scheduler.target.tokenizer, body.prompt,
                                      add_special_tokens=body.add_special_tokens))["input_ids"]
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": scheduler.context})


async def detokenize(request: Request) -> JSONResponse:
    """``POST /detokenize`` (vLLM's): ``{"tokens"}`` → ``{"prompt"}``."""
    scheduler = _scheduler(request)
    body = _small_body(await _read_body(request, request.app.state.max_request_bytes, request.app.state.body_timeout),
                       _DetokenizeRequest)
    check_model(body.model, scheduler.model_name)
    vocab_size = scheduler.target.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab_size]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the model's vocabulary (0 .. {vocab_size - 1})", "tokens")
    return JSONResponse({"prompt": scheduler.target.tokenizer.decode(body.tokens)})


async def completions(request: Request):
    return await _answer(request, COMPLETIONS)


async def chat_completions(request: Request):
    return await _answer(request, CHAT_COMPLETIONS)


async def _answer(request: Request, endpoint: Endpoint):
    """Prepare the request off the event loop, queue it, and answer in ``endpoint``'s format:
    one JSON response, or server-sent events once the generation has started (until then an
    error still gets its own status)."""
    scheduler = _scheduler(request)
    raw = await _read_body(request, request.app.state.max_request_bytes, request.app.state.body_timeout)
    async with request.app.state.preparing:
        try:
            body, job = await run_in_threadpool(prepare, scheduler, endpoint.request_model, raw,
                                                asyncio.get_running_loop())
        except ApiError as error:
            if error.status == 400:
                scheduler.count_invalid()
            raise
    scheduler.submit(job)
    prompt_tokens = sum(len(ids) for ids in {c.prompt: c.prompt_ids for c in job.choices}.values())
    reply = Reply(endpoint, scheduler.model_name, prompt_tokens, body.include_usage, request.app.state.token_texts,
                  body.logprobs_count() is not None, job.tools)
    async with _cancelled_if_the_client_leaves(request, scheduler, job):
        event = await job.events.get()
        if isinstance(event, Failed):
            raise event.error
        if not body.stream:
            return JSONResponse(await _whole(job, reply))
    return StreamingResponse(_chunks(job, scheduler, reply, [c.index for c in job.choices]),
                             media_type="text/event-stream")


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 once it passes ``limit`` bytes (declared or counted as it
    arrives): a huge body is never held in memory. (uvicorn reads and drops the rest of a
    refused body, for its keep-alive timeout at most, so the client gets to read the 413.) A body
    that has not arrived whole within ``timeout`` seconds is answered 408 and its connection
    closed."""
    too_large = ApiError(413, f"the request body exceeds the server's limit of {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0

    async def read() -> None:
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected") from None
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s ({size} bytes came)",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


@contextlib.asynccontextmanager
async def _cancelled_if_the_client_leaves(request: Request, scheduler: Scheduler, job: Job):
    """While the handler waits on ``job``, a disconnect cancels it, and a Failed(499) event lets
    the handler return at once (nobody reads its answer)."""

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scheduler.cancel(job, CLIENT_LEFT)
        job.events.put_nowait(Failed(ApiError(499, "the client disconnected")))

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


async def _whole(job: Job, reply: Reply) -> dict:
    while True:
        match await job.events.get():
            case TextPiece() as piece:
                reply.add_all([piece], formatted=False)
            case ChoiceDone():
                pass
            case Failed(error):
                raise error
            case Finished() as done:
                if done.interrupted:  # a partial text is no answer
                    raise shutting_down()
                return reply.whole(done)


class HeldToolReply:
    """A streamed chat choice under active tools. Its text is held while it may still become a
    call block (while its start, spaces stripped, is a prefix of ``<tool_call>``); once it cannot,
    the held pieces go out as content and the rest streams as it comes. A block is held whole and
    read back when the choice ends (``structured.parse_tool_reply``), as the whole response reads
    it: calls become ``tool_calls`` deltas, anything else (a block cut by ``max_tokens``) content."""

    def __init__(self, tools: ToolConfig):
        self.tools = tools
        self.held: list[TextPiece] = []
        self.text = ""
        self.content = False  # the reply is content: pieces pass through

    def feed(self, piece: TextPiece) -> list[TextPiece]:
        """The pieces to send now (``piece`` and any held before it, or none)."""
        if self.content:
            return [piece]
        self.held.append(piece)
        self.text += piece.text
        start = self.text.lstrip()
        if CALL_OPEN.startswith(start) or start.startswith(CALL_OPEN):
            return []
        self.content = True
        released, self.held = self.held, []
        return released

    def end(self) -> tuple[list[TextPiece], ToolReply | None]:
        """At the choice's end: the held pieces, and the reply read back (None: content)."""
        held, self.held = self.held, []
        return held, None if self.content else parse_tool_reply(self.text, self.tools)


async def _chunks(job: Job, scheduler: Scheduler, reply: Reply, indices: list[int]):
    """The server-sent events of a started job, always ending with ``data: [DONE]``; a client
    that goes away (the response task is cancelled) cancels the job. A choice's last chunk
    carries its ``finish_reason``; a shutdown ends the choices not yet done with "length".
    With tools, a choice's text is held while it may be a call block (``HeldToolReply``)."""
    ended = False
    finished: set[int] = set()
    held = {index: HeldToolReply(reply.tools) for index in indices} if reply.tools is not None else {}
    endpoint = reply.endpoint

    def content(pieces: list[TextPiece]) -> Iterator[str]:
        for piece in pieces:
            logprobs = reply.add(piece)
            if piece.text or logprobs:
                yield reply.chunk(endpoint.chunk_choice(piece.index, piece.text, None, logprobs))

    try:
        for index in indices:
            opening = endpoint.opening_choice(index, tools=reply.tools is not None)
            if opening is not None:
                yield reply.chunk(opening)
        while not ended:
            match await job.events.get():
                case TextPiece() as piece:
                    for chunk in content(held[piece.index].feed(piece) if held else [piece]):
                        yield chunk
                case ChoiceDone() as choice:
                    finished.add(choice.index)
                    finish_reason = choice.finish_reason
                    if held:
                        pieces, read_back = held[choice.index].end()
                        if read_back is not None and read_back.tool_calls:
                            logprobs = reply.add_all(pieces)
                            for call_choice in endpoint.calls_chunk_choice(choice.index, read_back.tool_calls, logprobs):
                                yield reply.chunk(call_choice)
                            finish_reason = read_back.finish_reason
                        else:
                            for chunk in content(pieces):
                                yield chunk
                    yield reply.chunk(endpoint.chunk_choice(choice.index, "", finish_reason, None))
                case Failed(error):
                    yield f"data: {json.dumps(error.body())}\n\n"
                    ended = True
                case Finished() as done:
                    for index in indices:
                        if index not in finished:  # stopped by the shutdown before it began
                            yield reply.chunk(endpoint.chunk_choice(index, "", "length", None))
                    if reply.include_usage:
                        yield reply.chunk(None, reply.usage(done))
                    ended = True
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            scheduler.cancel(job, CLIENT_LEFT)


def _json_error(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _api_error(request: Request, error: ApiError) -> JSONResponse:
    return _json_error(error)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    message = f"{request.method} {request.url.path}: {error.detail}"
    return _json_error(ApiError(error.status_code, message, kind=kind, headers=error.headers))


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug outside the worker (reading a request, say): a 500, counted in /health's ``failed``."""
    request.app.state.scheduler.count_failed()
    return _json_error(ApiError(500, f"internal error: {type(error).__name__}", kind="server_error"))


def create_app(scheduler: Scheduler, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               body_timeout: float = DEFAULT_BODY_TIMEOUT) -> Starlette:
    """The ASGI application serving ``scheduler`` (uvicorn runs it: ``serve``)."""
    if max_request_bytes < 1:
        raise TierspecError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if not body_timeout > 0:
        raise TierspecError(f"body_timeout must be > 0 seconds, got {body_timeout}")
    app = Starlette(
        routes=[Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
                Route("/v1/models/{model:path}", model, methods=["GET"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/chat/completions", chat_completions, methods=["POST"]),
                Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
                Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.scheduler, app.state.max_request_bytes, app.state.body_timeout = scheduler, max_request_bytes, body_timeout
    app.state.preparing = asyncio.Semaphore(PREPARING_AT_ONCE)
    app.state.token_texts = TokenTexts(scheduler.target.tokenizer)
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


class _JsonErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering a request it cannot parse (a garbage request line, a bad
    header) with OpenAI's error body in JSON instead of uvicorn's plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(ApiError(400, f"malformed HTTP request: {msg}").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server around a scheduler: on shutdown it stops the scheduler's requests before
    waiting for their connections, and the signal that stopped it is recorded instead of
    re-raised (a server that ended every request well exits 0)."""

    def __init__(self, scheduler: Scheduler, log_level: str, max_request_bytes: int,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT):
        # The graceful-shutdown timeout is a backstop only: the scheduler ends every request within a cycle.
        super().__init__(uvicorn.Config(create_app(scheduler, max_request_bytes, body_timeout), log_level=log_level,
                                        lifespan="off", timeout_graceful_shutdown=30, http=_JsonErrorsH11Protocol))
        self.scheduler = scheduler
        self.stopped_by: str | None = None

    def handle_exit(self, sig: int, frame) -> None:
        self.stopped_by = signal.Signals(sig).name
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.scheduler.stop()
        await super().shutdown(sockets)


def settle_heap() -> None:
    """Put what the server has loaded so far (the model, the tokenizer, the built default method)
    out of the garbage collector's reach (``gc.freeze``, after a collection of what start-up left):
    it lives as long as the server, and a full collection — one comes once ten middle-generation
    collections have run and the objects they promoted exceed a quarter of those the last full one
    left — would otherwise walk all of it while every running generation waits. On the default
    model's server the freeze's own collection, a walk of start-up's heap, took 113 ms; the last full
    collection, at exit, 124 ms unfrozen and 14 ms frozen (none came during a load benchmark's
    requests: results/zen4/stop74/server_gc_*.log). What was frozen is never
    collected: a default method the server's method cache later drops (its cost model's variants
    refer to one another) stays in memory — one method's worth, once."""
    gc.collect()
    gc.freeze()


def serve(scheduler: Scheduler, sock: socket.socket, log_level: str = "info",
          max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
    """Serve ``scheduler`` on ``sock`` (from ``listen``) until SIGINT or SIGTERM; then every open
    request gets a well-formed ending (see the module's docstring), a line on stderr says how
    the server stopped and what became of its requests, and this returns.

    The server's own signal handler stays installed after uvicorn restores the handlers it found
    (they are the server's too, set here first): a second SIGTERM during the teardown (the scheduler
    closing, the closing line) is one more request to stop, not the default action that killed
    the process with 143. (``tierspec serve`` ignores signals once this returns: the interpreter
    resets Python handlers to the default as it exits.)"""
    server = _Server(scheduler, log_level, max_request_bytes, body_timeout)
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, server.handle_exit)
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
    if server.started:
        counts = scheduler.health()
        how = f"stopped on {server.stopped_by}" if server.stopped_by else "stopped"
        print(f"tierspec serve: {how}; requests: {counts['completed']} completed, {counts['interrupted']} ended by the "
              f"shutdown, {counts['cancelled']} cancelled and {counts['withdrawn']} withdrawn by their clients, "
              f"{counts['failed']} failed, {counts['refused']} refused (queue full), {counts['invalid']} invalid (400)",
              file=sys.stderr, flush=True)


@contextlib.contextmanager
def serving_in_background(scheduler: Scheduler, host: str = "127.0.0.1", log_level: str = "warning",
                          start_timeout: float = 30.0, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                          body_timeout: float = DEFAULT_BODY_TIMEOUT) -> Iterator[int]:
    """Serve ``scheduler`` from a background thread of this process on a free port of ``host``
    (tests, the load benchmark); yields the port, and on exit shuts the server down as a
    signal would and closes the scheduler."""
    sock = listen(host, 0)
    port = sock.getsockname()[1]
    server = _Server(scheduler, log_level, max_request_bytes, body_timeout)
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
        scheduler.close()
