"""The server's scheduler: one loaded model, requests from a bounded queue, and **one executor** — a
worker thread running ``batch.BatchDecoder``'s cycles over every generation admitted (up to
``max_batch`` at once; requests' choices join and leave between cycles). It tells each request's
handler what happens through typed events (``Started``, then per choice ``TextPiece``… and
``ChoiceDone``, then ``Finished`` or ``Failed``). Nothing here knows HTTP beyond ``ApiError``, the
status and OpenAI error body an event or a refusal carries."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ..api import IncrementalDetokenizer, check_seed
from ..batch import BatchDecoder
from ..engine import kernel_report, runs_on_engine
from ..cached_model import PassResult
from ..decode import DecodeConfig, GenerationStats, Sequence, Step, TokenLogprob, score_prompt
from ..errors import TierspecError
from ..methods import Method, MethodOptions, build_method, check_method_name, default_method
from ..models import LoadedModel
from ..passes import PassBackend, PassRequest
from ..prompting import eos_ids
from ..structured import ToolConfig

log = logging.getLogger("tierspec.server")


#: Rows a prompt prefilled alone takes a pass: what a request that joins, a cancel or a shutdown waits at
#: most (a 2,048-token prompt alone, default model, 2 Zen 4 cores: 3.96 s in 512-row chunks, 3.85 s whole,
#: medians of 3 alternated rounds; an 8,000-token prompt's single pass kept a joining request 38 s).
LONE_PREFILL = 512


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
    """One request's generations: what the worker needs, and the channel back to its handler.
    ``tools``: the request's active tools (None: none), which the handler reads each choice's
    reply back with (``structured.parse_tool_reply``); the worker does not read them."""

    choices: list[Choice]
    method: str
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    tools: ToolConfig | None = None
    # Whether the handler sends text as it comes (server-sent events). A whole response's handler
    # reads only the end: its choices' text goes out once each, as they end (``ChoiceText``).
    stream: bool = True
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled_by: str | None = None  # CLIENT_LEFT or SHUTDOWN; set once, under the scheduler's lock
    pending: list[Choice] = field(default_factory=list)  # choices not started yet (no room in the batch)
    done: list[ChoiceDone] = field(default_factory=list)  # the ChoiceDone events sent so far
    started: bool = False  # Started was sent
    outbox: "Outbox | None" = None  # set when the worker admits the job: its events go out through it

    def send(self, event: Event) -> None:
        """Deliver ``event`` to the handler: through the worker's outbox once admitted (the worker
        is the only sender then), else at once (from any thread)."""
        if self.outbox is not None:
            self.outbox.post(self, event)
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Outbox:
    """The worker's events, held until its next pass begins, then handed to each event loop in
    one call (in the order they were posted).

    Why: a handler's work on an event (its text's JSON, the socket write) runs on the event loop's
    thread under the GIL. Handed over at once, as a cycle ends, it lands in the next cycle's
    drafting, verifying and committing, which hold the GIL too: the worker waits for the loop at
    every GIL release (every torch call), while the second core idles. Held until the pass, it runs
    while the engine computes without the GIL. An event waits at most for one cycle's drafting
    (``release`` is also called whenever the worker will run no pass: idle, or a cycle without
    one), and a cycle's events wake the loop once, not once each."""

    def __init__(self):
        self._held: list[tuple[Job, Event]] = []
        self.released = 0  # events handed over so far

    def post(self, job: Job, event: Event) -> None:
        self._held.append((job, event))

    @property
    def posted(self) -> int:
        return self.released + len(self._held)

    def release(self) -> None:
        """Hand every held event to its job's loop, one call per loop."""
        if not self._held:
            return
        held, self._held = self._held, []
        self.released += len(held)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Job, Event]]] = {}
        for job, event in held:
            by_loop.setdefault(job.loop, []).append((job, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed (the server went down mid-pass): nobody is listening
                pass


def _deliver(events: list[tuple[Job, Event]]) -> None:
    for job, event in events:
        job.events.put_nowait(event)


class _ReleasingPasses:
    """The batch's pass backend, releasing the outbox's events as each pass begins."""

    def __init__(self, inner: PassBackend, outbox: Outbox):
        self.inner, self.outbox = inner, outbox
        self.shares_passes = inner.shares_passes

    def run(self, requests: list[PassRequest]) -> list[PassResult]:
        self.outbox.release()
        return self.inner.run(requests)


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


# ---- the scheduler: one model, one executor ------------------------------------------------------


class Scheduler:
    """Runs requests' generations on one loaded model, from a bounded queue, on one worker thread
    (see the module doc).

    Admission is decided here (running + waiting ≤ ``max_batch`` + ``max_queue``) so that a full
    server answers at once instead of piling requests up. Built methods are kept for the last
    ``max_methods`` names a request asked for (each built once: its heads and pass-cost table are
    shared by every generation, which makes its own drafter and policy, with the request's
    ``num_draft``). A request's seed seeds its own generation, as the library's does: the scheduler
    keeps no random state of its own.
    """

    def __init__(self, target: LoadedModel, method: str | None = None, drafter: LoadedModel | None = None,
                 options: MethodOptions = MethodOptions(), max_queue: int = 8, max_methods: int = 4,
                 max_batch: int = 1, max_rows: int | None = None):
        """``method``: requests' default (None: ``methods.default_method(target)``). ``max_batch``:
        generations at once (``batch.BatchDecoder``: on the pass engine one batched pass per cycle;
        every request still gets exactly its solo text), at most ``max_rows`` rows per pass (a joining
        prompt is prefilled in the rows left); 1: one generation at a time."""
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
        # the engine's kernels on this CPU (``engine.kernel_report``), where the model runs on the engine
        self._kernels = {"kernels": kernel_report()} if runs_on_engine(target.model) else {}
        # checks max_batch, max_rows; a prompt alone is prefilled in chunks too: a request may join any time
        self.batch = BatchDecoder(target, max_batch=max_batch, max_rows=max_rows, lone_prefill=LONE_PREFILL)
        self._outbox = Outbox()  # the admitted jobs' events, released as each pass begins
        self.batch.passes = _ReleasingPasses(self.batch.passes, self._outbox)
        self.max_batch, self.max_rows = max_batch, max_rows
        self._methods: OrderedDict[str, Method] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # guards the fields below
        self._wake = threading.Condition(self._lock)
        self._waiting: list[Job] = []
        self._jobs: list[Job] = []  # admitted, in admission order
        self._live: dict[tuple[int, int], _Live] = {}  # the generations in the batch, by their key
        self._stopping = False
        self._counts = {"completed": 0, "cancelled": 0, "withdrawn": 0, "interrupted": 0, "failed": 0, "refused": 0,
                        "invalid": 0}
        self._worker = threading.Thread(target=self._loop, name="tierspec-generate", daemon=True)
        self._worker.start()

    def health(self) -> dict:
        """Status and counts: ``cancelled`` / ``withdrawn``: the client left during / before its
        generation; ``interrupted``: stopped or turned away by a shutdown; ``refused``: queue full;
        ``invalid``: answered 400 (a request the server cannot serve as asked, e.g. a method this
        model cannot build); ``failed``: the server's own errors (500). ``cycles``: where the
        executor's cycles went since the start (``decode.CycleTimes``)."""
        times = self.batch.times
        with self._lock:
            return {"status": "stopping" if self._stopping else "ok", "model": self.model_name,
                    "method": self.default_method, "running": len(self._jobs),
                    "waiting": len(self._waiting), "max_queue": self.max_queue,
                    "batch": {"max_batch": self.max_batch, "max_rows": self.max_rows,
                              "generations": len(self._live), "requests": len(self._jobs)},
                    # since the start: cycles, the generations and rows they carried, seconds by phase
                    "cycles": {"cycles": times.cycles, "sequences": times.sequences, "rows": times.rows,
                               "seconds": {k: round(v, 6) for k, v in times.to_dict().items()}},
                    "methods_cached": len(self._methods), **self._kernels, **self._counts}

    def method(self, name: str) -> Method:
        """The built method, from the cache when it was used lately (call it on the worker
        thread, or before serving starts)."""
        method = self._methods.pop(name, None)
        if method is None:
            # not strict: the server's options serve whichever method a request names
            method = build_method(name, self.target, self.drafter, self.options, strict=False)
        self._methods[name] = method
        while len(self._methods) > self.max_methods:
            self._methods.popitem(last=False)
        return method

    def count_invalid(self) -> None:
        """One more request refused as invalid (400) before it reached the queue."""
        with self._lock:
            self._counts["invalid"] += 1

    def count_failed(self) -> None:
        """One more request the server's own error failed (a 500) before it reached the queue."""
        with self._lock:
            self._counts["failed"] += 1

    def submit(self, job: Job) -> None:
        """Queue ``job``, or raise the 503 of a full or stopping server."""
        with self._lock:
            if self._stopping:
                raise shutting_down()
            if len(self._waiting) + len(self._jobs) >= self.max_batch + self.max_queue:
                self._counts["refused"] += 1
                raise ApiError(503, f"the server is busy ({self.max_queue} requests already waiting); retry shortly",
                               kind="server_busy", headers={"Retry-After": "1"})
            self._waiting.append(job)
            self._wake.notify()

    def cancel(self, job: Job, reason: str) -> None:
        """End ``job`` for ``reason``: a waiting job leaves the queue at once, a running one stops
        at its next cycle."""
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
        self._wake.notify()

    def stop(self) -> None:
        """Shut down: refuse new requests, turn the waiting ones away with 503, stop the
        running ones at their next cycle (their clients still get a well-formed ending)."""
        with self._lock:
            self._stopping = True
            for job in list(self._waiting) + list(self._jobs):
                self._cancel(job, SHUTDOWN)
            self._wake.notify()

    def close(self) -> None:
        """``stop``, then wait for the worker to finish."""
        self.stop()
        self._worker.join()

    # ---- the executor ----------------------------------------------------------------------------

    def _loop(self) -> None:
        """The worker: admit waiting jobs while the batch has room, run one cycle for every
        generation, hand each its text, finish the jobs whose choices are done."""
        while True:
            with self._lock:
                if not self._waiting and not self._jobs:
                    self._outbox.release()  # no pass is coming to release them
                while not self._waiting and not self._jobs and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._waiting and not self._jobs:
                    return
                admitted = self._admit()
            held = self._outbox.posted  # the events of the cycles before this one
            try:
                for job in admitted:
                    self._start_job(job)
                self._cycle()
            except Exception as error:  # a bug: every running job answers 500, the loop goes on
                log.exception("generation failed")
                failure = Failed(ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error"))
                for job in list(self._jobs):
                    self._end_job(job, "failed", failure)
            if self._outbox.released < held:  # this cycle ran no pass (a tiered rule's own passes, none at all)
                self._outbox.release()

    def _admit(self) -> list[Job]:
        """Waiting jobs that are admitted now (under the lock): while the batch has room for one
        more generation; a job's choices beyond the room wait inside it for places."""
        admitted = []
        room = self.max_batch - sum(len(job.pending) for job in self._jobs) - len(self._live)
        while self._waiting and room > 0:
            job = self._waiting.pop(0)
            job.outbox = self._outbox
            admitted.append(job)
            self._jobs.append(job)
            room -= len(job.choices)
        return admitted

    def _start_job(self, job: Job) -> None:
        """Build the job's method (a 400 when this model cannot) and start its choices."""
        try:
            method = self.method(job.method)
        except TierspecError as error:  # the method cannot be built for this model with these options
            self._end_job(job, "invalid", Failed(ApiError(400, str(error), "method")))
            return
        job.pending = list(job.choices)
        self._fill(job, method)

    def _fill(self, job: Job, method: Method | None = None) -> None:
        """Start the job's pending choices while the batch has room (score-only ones at once); the
        job's ``Started`` goes out with its first choice, so a choice the method refuses (a 400)
        still answers with its own status when it is the first."""
        while job.pending and len(self.batch) < self.max_batch and job.cancelled_by is None:
            choice = job.pending.pop(0)
            if choice.score_only:
                self._started(job)  # before the echoed text: a handler reads nothing ahead of Started
                done = self._score_only(job, choice)
            else:
                try:
                    check_seed(choice.seed)
                    sequence = self.batch.add((id(job), choice.index), method or self.method(job.method),
                                              choice.prompt_ids, choice.config, choice.seed)
                except TierspecError as error:
                    self._end_job(job, "invalid", Failed(ApiError(400, str(error), "method")))
                    return
                self._started(job)
                self._live[sequence.key] = _Live(job, choice, sequence, self.target.tokenizer)
                continue
            job.done.append(done)
            job.send(done)
        if not job.pending and not any(live.job is job for live in self._live.values()):
            self._finish_job(job)

    def _started(self, job: Job) -> None:
        if not job.started:
            job.started = True
            job.send(Started())

    def _cycle(self) -> None:
        """One cycle of every generation: each one's new text to its job; finished choices done;
        cancelled jobs out; waiting choices of running jobs into the places freed."""
        for job in list(self._jobs):
            if job.cancelled_by is not None:
                self._drop(job)
        if not self._live:
            return
        for sequence, step in self.batch.step():
            live = self._live[sequence.key]
            if live.feed(step):
                del self._live[sequence.key]
                self.batch.cancel(sequence.key)  # a stop sequence ends it before the batch would
                live.job.done.append(live.done())
                live.job.send(live.job.done[-1])
        for sequence in self.batch.take_failed():  # its own error: its job fails, the others go on
            live = self._live.get(sequence.key)
            if live is not None and live.job in self._jobs:
                self._end_job(live.job, "invalid", Failed(ApiError(400, str(sequence.error))))
        for job in list(self._jobs):
            if job.cancelled_by is None and job in self._jobs:
                self._fill(job)

    def _drop(self, job: Job) -> None:
        """Take a cancelled job's generations out and end it: nothing more for a client that left,
        a well-formed ending (its choices so far, interrupted) for a shutdown."""
        for live in [live for live in self._live.values() if live.job is job]:
            del self._live[live.sequence.key]
            self.batch.cancel(live.sequence.key)
            if job.cancelled_by == SHUTDOWN:
                job.done.append(live.done("length"))
                job.send(job.done[-1])
        job.pending = []
        if job.cancelled_by == CLIENT_LEFT:
            self._end_job(job, "cancelled", None)
        else:
            self._end_job(job, "interrupted", Finished(tuple(sorted(job.done, key=lambda c: c.index)), job.method, True))

    def _finish_job(self, job: Job) -> None:
        self._end_job(job, "completed", Finished(tuple(sorted(job.done, key=lambda c: c.index)), job.method))

    def _end_job(self, job: Job, outcome: str, last: Event | None) -> None:
        """``job`` leaves the scheduler with ``outcome`` counted; then its last event goes out (so a
        client that sends its next request as soon as it has its answer finds the room free)."""
        for live in [live for live in self._live.values() if live.job is job]:
            del self._live[live.sequence.key]
            self.batch.cancel(live.sequence.key)
        with self._lock:
            if job in self._jobs:
                self._jobs.remove(job)
            self._counts[outcome] += 1
        if last is not None:
            job.send(last)

    def _score_only(self, job: Job, choice: Choice) -> ChoiceDone:
        """A choice that generates nothing (``echo`` with no budget): the prompt's text and, if
        asked, its scores from one prefill."""
        config = choice.config
        records = tuple(score_prompt(self.target, choice.prompt_ids, config)) if config.score_prompt else ()
        job.send(TextPiece(choice.echo_text or "", choice.index, records, echo=True))
        return ChoiceDone(choice.index, "length", GenerationStats(), 0)


class ChoiceText:
    """What a choice's client is sent as its tokens are committed (``_Live``): the echoed prompt first, then each piece of text cut at the stop sequences;
    with logprobs, each piece carries the records of the tokens whose text it completes (a token's
    text starts at the sum of the texts before it), and a stop sequence drops the records of the
    tokens after the cut.

    A job that does not stream gets its choice's pieces as one, when the choice ends (``flush``):
    the same text and records its handler would join (``Reply.add_all``), without an event a cycle
    for the event loop to wake for — at 8 clients of 64-token replies those events were ~0.25 ms of
    the loop's ~0.4 ms of CPU a cycle, taken from the pass's threads on a 2-core machine."""

    def __init__(self, job: Job, choice: Choice, tokenizer):
        self.job, self.index = job, choice.index
        self.echo_text = choice.echo_text  # None once sent (or when there is none)
        self.stops = StopMatcher(job.stops)
        self.records = TokenRecords(tokenizer) if choice.config.logprobs is not None else None
        self.sent = 0  # characters sent (or held to be sent)
        self._held_text: list[str] = []
        self._held_records: list[TokenLogprob] = []

    def echo(self, prompt_logprobs) -> None:
        """The prompt's text once, scored by the generation's own prefill."""
        if self.echo_text is not None:
            self.job.send(TextPiece(self.echo_text, self.index, tuple(prompt_logprobs or ()), echo=True))
            self.echo_text = None

    def feed(self, piece: str, logprobs: list[TokenLogprob]) -> bool:
        """Send ``piece`` (``logprobs``: every record of the generation so far); True at a stop sequence."""
        text, stopped = self.stops.feed(piece) if piece else ("", False)
        self.sent += len(text)
        if self.records is not None:
            self.records.add(logprobs)
        if text:
            self._send(text, self.records.release(self.sent) if self.records is not None else ())
        return stopped

    def end(self, logprobs: list[TokenLogprob]) -> None:
        """The generation ended without a stop sequence: the held-back text and records."""
        if self.records is not None:
            self.records.add(logprobs)
        tail = self.stops.flush()
        rest = self.records.release(None) if self.records is not None else ()
        if tail or rest:
            self._send(tail, rest)
        self.flush()

    def flush(self) -> None:
        """A job that does not stream: send the pieces held so far as one (nothing when none)."""
        if self._held_text or self._held_records:
            text, records = "".join(self._held_text), tuple(self._held_records)
            self._held_text, self._held_records = [], []
            self.job.send(TextPiece(text, self.index, records))

    def _send(self, text: str, records: tuple[TokenLogprob, ...]) -> None:
        if not self.job.stream:
            self._held_text.append(text)
            self._held_records += records
        else:
            self.job.send(TextPiece(text, self.index, records))


class _Live:
    """One generation in the batch: its sequence, its text so far (an incremental detokeniser) and
    what its client is sent (``ChoiceText``)."""

    def __init__(self, job: Job, choice: Choice, sequence: Sequence, tokenizer):
        self.job, self.choice, self.sequence = job, choice, sequence
        self.detok = IncrementalDetokenizer(tokenizer)
        self.out = ChoiceText(job, choice, tokenizer)
        self.logprobs: list[TokenLogprob] = []
        self.finish: str | None = None
        self.kept: int | None = None  # at a stop sequence: the tokens of the text sent (``_tokens_of``)

    def feed(self, step: Step) -> bool:
        """Send ``step``'s new text; True when the generation is over (done or at a stop sequence)."""
        if step.logprobs is not None:
            self.logprobs.extend(step.logprobs)
        self.out.echo(step.prompt_logprobs)
        if self.out.feed(self.detok.add(step.committed.generated_view, final=step.finished), self.logprobs):
            self.finish = "stop"
            self.kept = _tokens_of(self.detok.tokenizer, self.sequence.token_ids, self.out.sent)
            return True
        if step.finished:
            self.out.end(self.logprobs)
            self.finish = self.sequence.finish_reason()  # the library's: a complete constrained text is "stop"
            return True
        return False

    def done(self, finish: str | None = None) -> ChoiceDone:
        """The choice's end; its completion tokens are those of the text sent: at a stop sequence not
        the ones committed past it (a cycle commits several tokens, and the text is cut inside them)."""
        self.out.flush()  # a job that does not stream: its choice's text, before its end
        sequence = self.sequence
        tokens = len(sequence.token_ids) if self.kept is None else self.kept
        return ChoiceDone(self.choice.index, finish or self.finish or "length", sequence.stats, tokens)


def _tokens_of(tokenizer, token_ids: list[int], characters: int) -> int:
    """The fewest leading ``token_ids`` whose text holds ``characters`` characters (the text cut at a
    stop sequence): the tokens a stopped choice reports as its completion's."""
    low, high = 0, len(token_ids)
    while low < high:  # the decoded text grows with the tokens
        middle = (low + high) // 2
        # a prefix ending inside a character decodes it as U+FFFD, which the text sent does not hold
        if len(tokenizer.decode(token_ids[:middle], skip_special_tokens=True).rstrip("\ufffd")) >= characters:
            high = middle
        else:
            low = middle + 1
    return low


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
