"""The scheduler's outbox: a cycle's events held until the next pass begins, then handed to each
event loop in one call, in the order they were posted (``server.scheduler.Outbox``)."""

from tierspec.server.scheduler import ChoiceDone, Finished, Job, Outbox, Started, TextPiece, _ReleasingPasses
from tierspec.decode import GenerationStats, TokenLogprob


class RecordingLoop:
    """An event loop stand-in: records what the worker hands it and runs it when asked."""

    def __init__(self):
        self.calls = []

    def call_soon_threadsafe(self, callback, *args):
        self.calls.append((callback, args))

    def run(self):
        calls, self.calls = self.calls, []
        for callback, args in calls:
            callback(*args)


class InnerPasses:
    shares_passes = True

    def __init__(self, loop):
        self.loop, self.calls_seen = loop, []

    def run(self, requests):
        self.calls_seen.append(len(self.loop.calls))  # what the loop had been handed when the pass began
        return ["result"] * len(requests)


def drained(job: Job) -> list:
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_a_cycles_events_wait_for_the_next_pass_and_go_out_in_one_call_in_order():
    loop, outbox = RecordingLoop(), Outbox()
    first, second = Job([], "hybrid", [], loop), Job([], "hybrid", [], loop)
    first.outbox = second.outbox = outbox
    done = ChoiceDone(0, "stop", GenerationStats(), 3)
    first.send(Started())
    second.send(Started())
    first.send(TextPiece("Hello", 0))
    second.send(TextPiece("Hi", 0))
    first.send(done)
    first.send(Finished((done,), "hybrid"))
    assert loop.calls == [] and outbox.posted == 6 and outbox.released == 0  # nothing handed over yet

    inner = InnerPasses(loop)
    passes = _ReleasingPasses(inner, outbox)
    assert passes.shares_passes
    assert passes.run(["a", "b"]) == ["result", "result"]
    assert inner.calls_seen == [1]  # handed over, in one call for the loop, before the pass ran
    assert outbox.released == 6
    loop.run()
    assert drained(first) == [Started(), TextPiece("Hello", 0), done, Finished((done,), "hybrid")]
    assert drained(second) == [Started(), TextPiece("Hi", 0)]

    passes.run(["a"])  # nothing held: the loop is not woken
    assert inner.calls_seen == [1, 0] and loop.calls == []


def test_each_loop_gets_its_own_events_and_a_job_not_admitted_sends_at_once():
    one, other, outbox = RecordingLoop(), RecordingLoop(), Outbox()
    admitted, waiting = Job([], "ar", [], one), Job([], "ar", [], other)
    admitted.outbox = outbox
    admitted.send(Started())
    waiting.send(Started())  # no outbox: straight to its loop (a queued job turned away by a shutdown)
    assert len(other.calls) == 1 and one.calls == []
    other_admitted = Job([], "ar", [], other)
    other_admitted.outbox = outbox
    other_admitted.send(TextPiece("x", 0))
    outbox.release()
    assert len(one.calls) == 1 and len(other.calls) == 2
    one.run()
    other.run()
    assert drained(admitted) == [Started()]
    assert drained(waiting) == [Started()] and drained(other_admitted) == [TextPiece("x", 0)]


def test_events_for_a_closed_event_loop_are_dropped_not_raised():
    """A shutdown during a long pass closed the event loop; the worker's next release raised
    RuntimeError('Event loop is closed') in its thread."""
    import asyncio
    from types import SimpleNamespace

    from tierspec.server.scheduler import Outbox

    loop = asyncio.new_event_loop()
    loop.close()
    outbox = Outbox()
    outbox.post(SimpleNamespace(loop=loop), "an event")
    outbox.release()
    assert outbox.released == 1


# ---- a choice's text: as it comes to a streaming job, once at its end to a whole response's ----------


class LetterTokenizer:
    """Token i's text is the i-th letter (wrapping), enough for ``TokenRecords``' offsets."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _choice_text(stream: bool, stops: list[str], logprobs: bool, echo: str | None = None):
    import torch

    from tierspec.decode import DecodeConfig
    from tierspec.server.scheduler import Choice, ChoiceText

    loop = RecordingLoop()
    job = Job([], "ar", stops, loop, stream=stream)
    choice = Choice(0, 0, torch.tensor([1, 2]), None, DecodeConfig(logprobs=1 if logprobs else None), echo_text=echo)
    return ChoiceText(job, choice, LetterTokenizer()), job, loop


def _fed(out, pieces, records, end: bool):
    """Feed ``pieces`` (records so far with each), then end, or at a stop sequence flush as
    ``_Live.done`` does (``end`` sends the held text itself)."""
    stopped = False
    for i, piece in enumerate(pieces):
        stopped = out.feed(piece, records[: i + 1])
        if stopped:
            break
    if end and not stopped:
        out.end(records)
    else:
        out.flush()
    return stopped


def _events(job, loop):
    loop.run()
    return drained(job)


PIECES = ["ab", "cd", "e", "fg"]
RECORDS = [TokenLogprob(i, -0.5 * i, ((i, -0.5 * i),)) for i in range(4)]


def test_a_whole_responses_job_gets_each_choices_text_once_as_its_pieces_joined():
    for stops, logprobs in (([], False), ([], True), (["e"], True), (["dx"], False), (["g"], True)):
        streamed, streamed_job, streamed_loop = _choice_text(True, stops, logprobs, echo="Q: ")
        whole, whole_job, whole_loop = _choice_text(False, stops, logprobs, echo="Q: ")
        streamed.echo(None)
        whole.echo(None)
        assert _fed(streamed, PIECES, RECORDS, end=True) == _fed(whole, PIECES, RECORDS, end=True)
        sent, held = _events(streamed_job, streamed_loop), _events(whole_job, whole_loop)
        assert sent[0] == held[0] == TextPiece("Q: ", 0, (), echo=True)  # the echo goes out at once either way
        assert len(held) == 2 and len(sent) > 2, (stops, logprobs)  # one piece for the whole text
        assert held[1].text == "".join(piece.text for piece in sent[1:]), (stops, logprobs)
        assert held[1].logprobs == tuple(r for piece in sent[1:] for r in piece.logprobs), (stops, logprobs)
        assert whole.sent == streamed.sent


def test_a_whole_responses_job_gets_nothing_until_its_choice_ends_and_no_empty_piece():
    whole, job, loop = _choice_text(False, [], False)
    whole.feed("ab", [])
    whole.feed("cd", [])
    assert _events(job, loop) == []  # held: the event loop is not woken a cycle for it
    whole.flush()
    whole.flush()  # twice: nothing more
    assert _events(job, loop) == [TextPiece("abcd", 0)]
    nothing, job, loop = _choice_text(False, [], False)
    nothing.end([])
    assert _events(job, loop) == []


class Committed:
    """A sequence's committed tokens as ``_Live`` reads them (``generated_view``: its generated ids)."""

    def __init__(self, tokens):
        self.generated_view = tokens


class FakeSequence:
    def __init__(self):
        self.token_ids: list[int] = []
        self.stats = GenerationStats()

    def finish_reason(self):
        return "length"


def _live_events(stream: bool, stops: list[str], steps: list[list[int]], finishes: bool):
    """A ``_Live`` of a job fed ``steps`` (new token ids each; letters a, b, …), the last one
    finishing the generation when ``finishes``; its job's events once the choice is done."""
    import torch

    from tierspec.decode import CycleStats, DecodeConfig, Step
    from tierspec.server.scheduler import Choice, _Live

    loop = RecordingLoop()
    job = Job([], "ar", stops, loop, stream=stream)
    sequence = FakeSequence()
    live = _Live(job, Choice(0, 0, torch.tensor([1]), None, DecodeConfig()), sequence, LetterTokenizer())
    over = False
    for i, new in enumerate(steps):
        sequence.token_ids += new
        last = finishes and i == len(steps) - 1
        over = live.feed(Step(new, CycleStats(0, 0, 0, len(new), 1, 0, 0, 0.0), last,
                              committed=Committed(list(sequence.token_ids))))
        if over:
            break
    assert over
    job.send(live.done())
    return _events(job, loop)


def test_a_whole_responses_choice_sends_its_text_once_before_its_end_at_a_stop_and_at_the_end():
    from tierspec.server.scheduler import ChoiceDone as Done

    steps = [[0, 1], [2], [3, 4], [5]]  # "ab", "c", "de", "f"
    for stops, finishes, text in ((["d"], False, "abc"), ([], True, "abcdef"), (["zz"], True, "abcdef")):
        held = _live_events(False, stops, steps, finishes)
        assert [type(event) for event in held] == [TextPiece, Done], (stops, finishes)
        assert held[0] == TextPiece(text, 0), (stops, finishes)
        streamed = _live_events(True, stops, steps, finishes)
        assert "".join(event.text for event in streamed[:-1]) == text and len(streamed) > 2
        assert held[1] == streamed[-1]  # the same end: reason, tokens
