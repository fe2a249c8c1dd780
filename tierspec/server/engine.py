"""The engine behind the server: one loaded model, one request at a time from a bounded queue,
on a worker thread that tells each request's handler what happens through typed events
(``Started``, then per choice ``TextPiece``… and ``ChoiceDone``, then ``Finished`` or
``Failed``). A request's choices (its prompts × ``n``) are generated one after another. Nothing
here knows HTTP beyond ``ApiError``, the status and OpenAI error body an event or a refusal
carries."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch

from ..api import stream_method
from ..decode import DecodeConfig, GenerationStats, TokenLogprob, score_prompt
from ..errors import TierspecError
from ..methods import Method, MethodOptions, build_method, check_method_name, default_method
from ..models import LoadedModel
from ..prompting import eos_ids

log = logging.getLogger("tierspec.server")


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry on another instance or after it restarts",
                    kind="server_shutting_down")


# ---- events: what the worker tells a request's handler ---------------------------------------------


@dataclass(frozen=True)
class Started:
    """The method is built and the generation begins (errors before this are the request's)."""


@dataclass(frozen=True)
class TextPiece:
    """Text of choice ``index``, with the logprob records of the tokens that wrote it (when asked
    for). ``echo``: the prompt, sent first (its first token's logprob is None)."""

    text: str
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    echo: bool = False


@dataclass(frozen=True)
class ChoiceDone:
    index: int
    finish_reason: str  # "stop" (end of sequence or a stop string) or "length"
    stats: GenerationStats
    completion_tokens: int


@dataclass(frozen=True)
class Finished:
    """Every choice is done (or the shutdown ``interrupted`` them)."""

    choices: tuple[ChoiceDone, ...]
    method: str
    interrupted: bool = False  # stopped early by a shutdown

    @property
    def completion_tokens(self) -> int:
        return sum(choice.completion_tokens for choice in self.choices)


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | TextPiece | ChoiceDone | Finished | Failed

# Why a job was cancelled.
CLIENT_LEFT, SHUTDOWN = "client left", "shutdown"


@dataclass(frozen=True)
class Choice:
    """One generation of a request: choice ``index`` (OpenAI's order: prompt by prompt, ``n`` each)
    after prompt number ``prompt`` with its own seed. ``echo_text``: the prompt's text, sent first
    (``echo``). ``score_only``: nothing to generate (``max_tokens: 0`` with ``echo``)."""

    index: int
    prompt: int
    prompt_ids: torch.Tensor  # [n]
    seed: int | None
    config: DecodeConfig
    score_only: bool = False
    echo_text: str | None = None


@dataclass(eq=False)
class Job:
    """One request's generations: what the worker needs, and the channel back to its handler."""

    choices: list[Choice]
    method: str
    num_draft: int | None
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
    the draft head, the forward-cost table) is built once whatever the value. A request's seed
    seeds its own generation (``api.stream_method``, as the library does): the engine keeps no
    random state of its own.
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
        self._counts = {"completed": 0, "cancelled": 0, "withdrawn": 0, "interrupted": 0, "failed": 0, "refused": 0,
                        "invalid": 0}

    def health(self) -> dict:
        """Status and counts: ``cancelled`` / ``withdrawn``: the client left during / before its
        generation; ``interrupted``: stopped or turned away by a shutdown; ``refused``: queue full;
        ``invalid``: answered 400 (a request the server cannot serve as asked, e.g. a method this
        model cannot build); ``failed``: the server's own errors (500)."""
        with self._lock:
            return {"status": "stopping" if self._stopping else "ok", "model": self.model_name,
                    "method": self.default_method, "running": int(self._running is not None),
                    "waiting": len(self._waiting), "max_queue": self.max_queue,
                    "methods_cached": len(self._methods), **self._counts}

    def method(self, name: str, num_draft: int | None) -> Method:
        """The built method, from the cache when it was used lately (call it on the worker
        thread, or before serving starts)."""
        key = (name, num_draft)
        method = self._methods.pop(key, None)
        if method is None:
            options = self.options if num_draft is None else replace(self.options, num_draft=num_draft)
            method = build_method(name, self.target, self.drafter, options)
        self._methods[key] = method
        while len(self._methods) > self.max_methods:
            self._methods.popitem(last=False)
        return method

    def count_invalid(self) -> None:
        """One more request refused as invalid (400) before it reached the queue."""
        with self._lock:
            self._counts["invalid"] += 1

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise the 503 of a full or stopping server."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if len(self._waiting) + (self._running is not None) >= 1 + self.max_queue:
                self._counts["refused"] += 1
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
            self._counts["withdrawn" if reason == CLIENT_LEFT else "interrupted"] += 1
            if reason == SHUTDOWN:
                job.send(Failed(shutting_down()))

    def stop(self) -> None:
        """Shut down: refuse new requests, turn the waiting ones away with 503, stop the
        running one at its next cycle (its client still gets a well-formed ending)."""
        with self._lock:
            self._stopping = True
            for job in list(self._waiting):
                self._cancel(job, SHUTDOWN)
            if self._running is not None:
                self._cancel(self._running, SHUTDOWN)

    def close(self) -> None:
        """``stop``, then wait for the worker to finish."""
        self.stop()
        self._worker.shutdown(wait=True)

    def _run(self, job: Job) -> None:
        """The worker: build the method, generate, send Started, TextPiece…, Finished (or Failed).
        The last event goes out after the job has left the engine, so a client that sends its
        next request as soon as it has its answer finds the server free."""
        with self._lock:
            if job not in self._waiting:  # withdrawn or turned away while it waited: already answered
                return
            self._waiting.remove(job)
            self._running = job
        outcome, last = "failed", None
        try:
            try:
                method = self.method(job.method, job.num_draft)
            except TierspecError as error:  # the method cannot be built for this model with these options
                outcome, last = "invalid", Failed(ApiError(400, str(error), "method"))
            else:
                job.send(Started())
                outcome, last = self._generate_all(job, method)
        except Exception as error:  # a bug: the handler answers 500, the log keeps the traceback, the worker goes on
            log.exception("generation failed")
            last = Failed(ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error"))
        finally:
            with self._lock:
                self._running = None
                self._counts[outcome] += 1
            if last is not None:
                job.send(last)

    def _generate_all(self, job: Job, method: Method) -> tuple[str, Finished | Failed | None]:
        """Every choice of ``job`` in order: its outcome and its last event (None when its client
        has left)."""
        done = []
        for choice in job.choices:
            try:
                done.append(self._generate(job, choice, method))
            except TierspecError as error:  # e.g. logprobs from a method with a slim tier
                return "invalid", Failed(ApiError(400, str(error), "method"))
            job.send(done[-1])
            if job.cancelled_by is not None:
                break
        if job.cancelled_by == CLIENT_LEFT:
            return "cancelled", None
        interrupted = job.cancelled_by == SHUTDOWN
        return "interrupted" if interrupted else "completed", Finished(tuple(done), job.method, interrupted)

    def _generate(self, job: Job, choice: Choice, method: Method) -> ChoiceDone:
        """One generation, cut at stop sequences, stopped at the next cycle once cancelled. With
        logprobs, each piece carries the records of the tokens whose text it completes (a token's
        text starts at the sum of the texts before it); a stop sequence drops the records of the
        tokens after the cut."""
        index, config = choice.index, choice.config
        if choice.score_only:
            records = tuple(score_prompt(self.target, choice.prompt_ids, config)) if config.score_prompt else ()
            job.send(TextPiece(choice.echo_text or "", index, records, echo=True))
            return ChoiceDone(index, "length", GenerationStats(), 0)
        text_stream = stream_method(self.target, method, choice.prompt_ids, config, choice.seed)
        echo_pending = choice.echo_text is not None

        def send_echo() -> None:  # the prompt first, scored by the generation's own prefill
            nonlocal echo_pending
            if echo_pending:
                job.send(TextPiece(choice.echo_text, index, tuple(text_stream.prompt_logprobs or ()), echo=True))
                echo_pending = False

        stops = StopMatcher(job.stops)
        records = TokenRecords(self.target.tokenizer) if config.logprobs is not None else None
        finish, sent = None, 0  # characters sent
        try:
            for piece in text_stream:
                send_echo()
                text, stopped = stops.feed(piece)
                sent += len(text)
                if records is not None:
                    records.add(text_stream.logprobs)
                if text:
                    job.send(TextPiece(text, index, records.release(sent) if records is not None else ()))
                if stopped:
                    finish = "stop"
                    break
                if job.cancelled_by is not None:
                    break
        finally:
            text_stream.close()
        token_ids = text_stream.token_ids
        send_echo()
        if finish is None:
            if records is not None:
                records.add(text_stream.logprobs)
            tail = stops.flush()
            rest = records.release(None) if records is not None else ()
            if tail or rest:
                job.send(TextPiece(tail, index, rest))
            finish = "stop" if token_ids and token_ids[-1] in self.eos else "length"
        return ChoiceDone(index, finish, text_stream.stats, len(token_ids))


class TokenRecords:
    """The logprob records of a generation not yet sent, with where each token's text starts
    (the sum of the texts of the tokens before it, each decoded alone)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.seen = 0  # records taken from the stream
        self.waiting: list[tuple[int, TokenLogprob]] = []  # (offset, record)
        self.end = 0  # the text offset after the last record taken

    def add(self, stream_records: list[TokenLogprob]) -> None:
        for record in stream_records[self.seen:]:
            self.waiting.append((self.end, record))
            self.end += len(self.tokenizer.decode([record.token], skip_special_tokens=True))
        self.seen = len(stream_records)

    def release(self, sent: int | None) -> tuple[TokenLogprob, ...]:
        """The records of tokens whose text starts before ``sent`` characters (None: all)."""
        count = len(self.waiting) if sent is None else sum(1 for offset, _ in self.waiting if offset < sent)
        released, self.waiting = self.waiting[:count], self.waiting[count:]
        return tuple(record for _, record in released)
