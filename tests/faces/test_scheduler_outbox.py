"""The scheduler's outbox: a cycle's events held until the next pass begins, then handed to each
event loop in one call, in the order they were posted (``server.scheduler.Outbox``)."""

from tierspec.server.scheduler import ChoiceDone, Finished, Job, Outbox, Started, TextPiece, _ReleasingPasses
from tierspec.decode import GenerationStats


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
