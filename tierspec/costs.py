"""Forward-pass cost per number of new tokens, measured once per model and machine.

On a CPU the cost of a target pass is not linear in the number of tokens it scores: a pass over
2–3 new tokens can cost more than one over 4–8 (BENCHMARKS.md has the measured tables). Two
things follow:

* a verification of n tokens can be *padded* to the cheapest size n' ≥ n (the extra rows are
  copies of the last token, their outputs are ignored and their KV rolled back), and
* a draft-length policy must use this table, not a straight line.

The table is measured once per process and cached as JSON under ``$TIERSPEC_CACHE`` keyed by
the model's identity, the thread count, the CPU and the linear kernels in use, and reused by
later runs while spot checks agree with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .cached_model import CachedModel
from .models import LoadedModel, model_code
from .seq2seq import measuring_runner
from .util import atomic_write_text, cache_root


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


#: Cached positions the table's passes run after, and the longer context whose passes give each
#: size's cost per further cached position (``ForwardCosts.per_position``): every row of a pass
#: attends to every cached position, so at 1,000 positions a row's attention is a large share of
#: what a draft row adds (on a 2-core Zen 3 a 2-row pass of the default model costs 1.09× one row
#: after 256 positions, 1.16× in Spec-Bench's generations); measured, not assumed, as the rows are.
TABLE_CONTEXT = 256
LONG_CONTEXT = 1024
#: Rounds of passes a forward-cost table is measured from (each size once a round, ``paired_costs``), at
#: ``TABLE_CONTEXT`` and as many at ``LONG_CONTEXT``: each size's cost per further position is the difference
#: of the two, whose 1-token passes are each the fastest of its rounds — of as many rounds, or the fewer would
#: run slower and lean the difference. On a 2-core Zen 3 VM (``results/zen3/stop76/table_rounds.log``)
#: subsets of 20 of 40 rounds read a 2-token pass 1.10–1.18× a 1-token one by their paired medians, subsets of 5
#: 1.06–1.26 (5–95%; subsets of one run overlap, so a fresh measurement scatters more: two at 20 rounds read 3
#: tokens 1.27× and 1.38×). Measuring the default model's table took 11.2 s there at 20 rounds at both contexts,
#: 4.3 s at 5 — once per machine and code version (a tree method's 16 sizes take longer).
TABLE_ROUNDS = 20
#: Contexts are costed in steps of this many positions (a policy's costs are re-derived per step).
CONTEXT_STEP = 64


@dataclass
class ForwardCosts:
    """seconds[n] = the time of a cached forward over n new tokens (n = 1 .. max) after ``context``
    cached positions, measured in rounds (``measure_forward_costs``, ``paired_costs``); and
    per_position[n] = what each further cached position adds to it (from the same sizes after
    ``LONG_CONTEXT`` positions; None when the model holds too few positions or a table predates it)."""

    seconds: dict[int, float]
    context: int = TABLE_CONTEXT
    per_position: dict[int, float] | None = None
    # padded_size by n and cost by (n, context), filled as asked (the policies of a batch ask for the same
    # few sizes every cycle; the table does not change once made)
    _padded: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _costs: dict[tuple[int, int | None], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def max_tokens(self) -> int:
        return max(self.seconds)

    def padded_size(self, n: int) -> int:
        """The cheapest measured size n' ≥ n (n itself beyond the table)."""
        size = self._padded.get(n)
        if size is None:
            size = n if n > self.max_tokens else min((m for m in self.seconds if m >= n),
                                                     key=lambda m: (self.seconds[m], m))
            self._padded[n] = size
        return size

    def cost(self, n: int, context: int | None = None) -> float:
        """Seconds for a pass over n tokens, padded to the cheapest size (linear beyond the table),
        after ``context`` cached positions (None: the table's own context): the table's seconds
        plus ``per_position`` for the positions more (or less: never below half the table's)."""
        seconds = self._costs.get((n, context))
        if seconds is None:
            seconds = self._costs[(n, context)] = self._cost(n, context)
        return seconds

    def _cost(self, n: int, context: int | None) -> float:
        top = self.max_tokens
        size = self.padded_size(n) if n <= top else n
        if n <= top:
            seconds = self.seconds[size]
        else:
            slope = (self.seconds[top] - self.seconds[1]) / max(top - 1, 1)
            seconds = self.seconds[top] + max(slope, 0.0) * (n - top)
        if context is None or not self.per_position or context == self.context:
            return seconds
        if size <= top:
            per_position = self.per_position[size]
        else:
            per_row = (self.per_position[top] - self.per_position[1]) / max(top - 1, 1)
            per_position = self.per_position[top] + max(per_row, 0.0) * (size - top)
        return max(seconds + per_position * (context - self.context), 0.5 * seconds)


def measure_forward_costs(model: torch.nn.Module, max_tokens: int = 16, context: int = TABLE_CONTEXT,
                          repeats: int = TABLE_ROUNDS, long_context: int = LONG_CONTEXT) -> ForwardCosts:
    """The table (``ForwardCosts``) of ``model``'s cached passes over 1 .. ``max_tokens`` new tokens after
    ``context`` cached positions, and each size's cost per further position from its passes after
    ``long_context`` (none for a ``long_context`` below ``context`` + ``CONTEXT_STEP``), both from
    ``repeats`` rounds (``paired_costs``, ``TABLE_ROUNDS``)."""
    from .engine import threads_for

    with threads_for(model):  # as a generation runs its passes (engine.threads_for)
        return _measure_forward_costs(model, max_tokens, context, repeats, long_context)


def _timed_rounds(runner: CachedModel, sizes: list[int], context: int, repeats: int) -> dict[int, list[float]]:
    """Seconds of each size's pass in each of ``repeats`` rounds after ``context`` cached positions (the runner
    holds them), the sizes taken in turn round after round, after a round that warms every size's kernels."""
    vocab = runner.vocab_size
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for round_ in range(repeats + 1):
        for n in sizes:
            tokens = (torch.arange(n) * 7 + 11) % vocab
            started = time.perf_counter()
            runner.forward(tokens, logits_for=n)
            elapsed = time.perf_counter() - started
            runner.rollback(context)
            if round_:  # the first round warms every size's kernels
                samples[n].append(elapsed)
    return samples


def paired_costs(samples: dict[int, list[float]]) -> dict[int, float]:
    """Seconds by size from rounds of passes (``samples[n][r]``: size n's pass in round r, every size
    timed in every round, ``_timed_rounds``): the first size's fastest pass, and every other size's that
    times the median over the rounds of its pass ÷ the same round's pass of the first size.

    Why paired: the policies choose draft lengths by the table's ratios, and a shared machine's speed
    drifts, moving the passes of a round (~0.15 s for the default model's 11 sizes) together. Each size's
    fastest pass on its own (the table's estimator before) takes each size's luckiest round: on a 2-core
    Zen 3 VM, from 40 rounds of the default model, 3 and 4 tokens read 1.12× and 1.22× one token by their
    fastest passes, 1.25× and 1.38× by the paired median (``results/zen3/stop76/table_rounds.log``), where
    that machine's generations' 3-token passes took 1.17–1.27× their 1-token ones (the medians in
    ``results/zen3/stop75/pass_rows.log``, greedy and at t=1, with and without the head's features). Drift
    within a round is not paired away: the widest sizes run furthest from their round's first pass."""
    first = min(samples)
    base = samples[first]
    fastest = min(base)
    seconds = {first: fastest}
    for n, passes in samples.items():
        if n != first:
            if len(passes) != len(base):
                raise ValueError(f"size {n} was timed in {len(passes)} rounds and size {first} in {len(base)}: "
                                 "each round pairs one pass of every size")
            ratios = [t / b for t, b in zip(passes, base) if b > 0]  # (a pass the clock did not see: no ratio)
            seconds[n] = fastest * statistics.median(ratios) if ratios else min(passes)
    return seconds


def _measure_forward_costs(model: torch.nn.Module, max_tokens: int, context: int, repeats: int,
                           long_context: int) -> ForwardCosts:
    runner = measuring_runner(model)  # an encoder–decoder model's decoder, against a source
    vocab = runner.vocab_size
    sizes = list(range(1, max_tokens + 1))
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int):  # room for the longer context's widest pass
        long_context = min(long_context, limit - max_tokens)
    with torch.inference_mode():
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        seconds = paired_costs(_timed_rounds(runner, sizes, context, repeats))
        per_position = None
        if long_context >= context + CONTEXT_STEP:
            runner.forward((torch.arange(context, long_context) * 3 + 5) % vocab, logits_for=1)
            longer = paired_costs(_timed_rounds(runner, sizes, long_context, repeats))
            span = long_context - context
            per_position = {n: max(longer[n] - seconds[n], 0.0) / span for n in sizes}
    return ForwardCosts(seconds, context, per_position)


def _linear_kind(model: torch.nn.Module, with_threads: bool = True) -> str:
    """Which linear kernels and weight dtype the model runs (the table depends on both: see
    ``kernels``); for the pass engine, its numerics and the kernel path they take on this CPU
    (``quant.kernel_key``), so a new kernel never reads an old table, and (``with_threads``) the
    threads its few-row products run on (``few_row_threads``), when set."""
    from .kernels import FewRowLinear, PackedLinear
    from .quant import QuantLinear

    from .quant import kernel_key

    quantised = next((m for m in model.modules() if isinstance(m, QuantLinear)), None)
    if quantised is not None:  # the engine: its numerics, the kernel path they run on here, the few-row threads
        rows = quantised.qweight.one_thread_rows
        threads = "" if rows is None or not with_threads else f":one-thread-rows{rows}"
        return f"gguf:{kernel_key(quantised.qweight.numerics)}{threads}"
    kinds = {type(m) for m in model.modules()}
    kind = "packed-v1" if PackedLinear in kinds else "few-row-v2" if FewRowLinear in kinds else "linear"
    return f"{kind}:{str(getattr(model, 'dtype', '')).replace('torch.', '')}"


def _read_table(path: Path, max_tokens: int) -> ForwardCosts | None:
    """The table in ``path`` if it has the expected shape (1..max_tokens → positive seconds)."""
    try:
        data = json.loads(path.read_text())
        seconds = {int(n): float(v) for n, v in data["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if sorted(seconds) != list(range(1, max_tokens + 1)):
        return None
    if not all(math.isfinite(v) and 0 < v < 60 for v in seconds.values()):
        return None
    per_position, context = data.get("per_position"), data.get("context", TABLE_CONTEXT)
    if per_position is not None:
        try:
            per_position = {int(n): float(v) for n, v in per_position.items()}
        except (ValueError, TypeError, AttributeError):
            return None
        if sorted(per_position) != sorted(seconds) or not all(math.isfinite(v) and 0 <= v < 1 for v in per_position.values()):
            return None
    if not isinstance(context, int) or context < 0:
        return None
    return ForwardCosts(seconds, context, per_position)


def spot_check(model: torch.nn.Module, repeats: int = 3, context: int = 64) -> float:
    """Seconds of a cached 1-token pass now (the fastest of ``repeats``; a few passes after a
    ``context``-token prefill). Only the pass at this context: the table's per-position part
    (``LONG_CONTEXT``) costs a prefill of a thousand tokens, which every cached measurement's check
    ran at a generation's start: 3.1 s of spot checks in a profile of one default `tierspec generate`
    on a Zen 4, whose cached start-up went 5.41 → 2.69 s without them (``benchmarks/memory_startup.py``)."""
    return measure_forward_costs(model, max_tokens=1, context=context, repeats=repeats, long_context=0).seconds[1]


def forward_costs(target: LoadedModel, max_tokens: int = 16, refresh: bool = False) -> ForwardCosts:
    """The table for this model on this machine: measured once per process (about 11 s for the default
    model on a 2-core Zen 3), and cached across processes; see ``_cached_measurement`` for when a cached table is re-measured."""
    return _cached_measurement(target, "forward-costs", f"forward cost for 1..{max_tokens} tokens",
                               {"max_tokens": max_tokens, "contexts": [TABLE_CONTEXT, LONG_CONTEXT]},
                               lambda path: _read_table(path, max_tokens),
                               lambda: measure_forward_costs(target.model, max_tokens),
                               lambda table: {"seconds": table.seconds, "context": table.context,
                                              "per_position": table.per_position},
                               lambda table: table.seconds[1], refresh)


# Measurements made by this process, by cache key: each is made (or read and checked) once.
_MEASURED: dict[str, object] = {}
# Seconds this process has spent making or checking measurements (``measuring_seconds``).
_MEASURING_SECONDS = [0.0]


def measuring_seconds() -> float:
    """Seconds this process has spent measuring costs or checking cached measurements so far: one-time
    work that may fall inside a generation's first steps, which ``decode.DecodeRun`` leaves out of its
    wall clock (a first run's tokens per second read a third of the true one)."""
    return _MEASURING_SECONDS[0]
# One measurement at a time in a process: two threads measuring at once would each time the
# other's load, and both would measure what one measurement gives.
_MEASURING = threading.Lock()
SPOT_CHECKS = 3  # spot checks of a cached table before it is judged off (one can hit a blip)
#: A cached measurement whose 1-token pass is more than this many times slower than a spot check
#: now was made on a busier machine than this one is now, and is measured again. Not 2×: the
#: load changes the ratios the policies choose by, not only the scale — on a 2-core Zen 3 VM the
#: float32-row table in use had been measured while a 1-token pass took 14.5 ms and gave a
#: 2-token pass 1.11× and a 4-token pass 1.87× one token; measured again three times when it
#: took 8.9 ms, 1.18–1.20× and 2.15–2.19×; with the first, the default method at temperature 1
#: drafted 1-token n-gram blocks (12% accepted) whose passes cost 22% more and paid nothing.
FASTER_NOW = 1.3
#: A spot check this many times slower than the cached measurement: the machine is busy now
#: (a measurement now would record the load), and the cached one is kept.
SLOWER_NOW = 2.0


def _agrees(table_seconds: float, now: float) -> bool:
    """A table's 1-token pass and a spot check agree: now at most ``SLOWER_NOW`` times slower
    and at most ``FASTER_NOW`` times faster."""
    return 1.0 / SLOWER_NOW <= table_seconds / now <= FASTER_NOW


_FINGERPRINT: list[str] = []


def code_fingerprint() -> str:
    """A digest of tierspec's own code as installed (every Python module and compiled extension of
    the package), made once per process. It keys every cached measurement: a measurement times
    this code (a draft step's Python, the engine's kernels), so a cache made by other code — an
    upgrade, a checkout beside this one — is measured again rather than read, where a spot check
    of the target's pass alone would pass a draft step that got cheaper or dearer."""
    if not _FINGERPRINT:
        package = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted(package.rglob("*")):
            if path.suffix in (".py", ".so", ".pyd") and path.is_file() and "__pycache__" not in path.parts:
                digest.update(path.relative_to(package).as_posix().encode() + b"\0")
                digest.update(hashlib.sha256(path.read_bytes()).digest())
        _FINGERPRINT.append(digest.hexdigest()[:16])
    return _FINGERPRINT[0]


def _cached_measurement(target: LoadedModel, prefix: str, what: str, key_extra: dict, read, measure, to_json,
                        one_token_seconds, refresh: bool):
    """A measurement of ``target`` on this machine, made at most once per process (under a lock:
    a second thread waits for the first's) and cached as JSON under ``$TIERSPEC_CACHE`` keyed by
    the model's identity, the thread count, the CPU, torch, the linear kernels and tierspec's code
    (``code_fingerprint``). ``read(path)``
    returns it or None when the file is damaged.

    A cached measurement is checked by up to ``SPOT_CHECKS`` spot checks of a 1-token pass
    against its ``one_token_seconds``: one that agrees (``_agrees``) keeps it. When every check is
    more than ``SLOWER_NOW`` times slower, the machine is busy now: the cached measurement is kept
    (one made now would record the load). When they are more than ``FASTER_NOW`` times faster,
    the cached one was made on a busier machine (or another machine): it is measured again, so
    that the cache moves toward the quiet machine's measurement and stays there. A new
    measurement whose 1-token pass disagrees with a spot check right after it was disturbed by
    load: this process uses it, no file keeps it. Every decision other than reusing the file is
    one line on stderr. Any measurement but the few-row threads' (``few_row_threads``) first
    sets those threads, and its key names them."""
    measures_threads = prefix == FEW_ROW_PREFIX
    if not measures_threads:  # every other measurement times the passes a generation runs: on their threads
        few_row_threads(target)
    key = json.dumps({"model": target.identity.to_dict(), "threads": torch.get_num_threads(), "cpu": _cpu_name(),
                      "torch": torch.__version__, "linear": _linear_kind(target.model, with_threads=not measures_threads),
                      "code": model_code(target.model), "tierspec": code_fingerprint(), **key_extra}, sort_keys=True)
    with _MEASURING:
        if refresh or key not in _MEASURED:  # (the few-row threads are settled before, outside the lock)
            began = time.perf_counter()
            try:
                _MEASURED[key] = _read_or_measure(target, prefix, what, key, read, measure, to_json,
                                                  one_token_seconds, refresh)
            finally:
                _MEASURING_SECONDS[0] += time.perf_counter() - began
        return _MEASURED[key]


def _read_or_measure(target: LoadedModel, prefix: str, what: str, key: str, read, measure, to_json, one_token_seconds,
                     refresh: bool):
    """The cached measurement if it passes the spot checks, else a new one (see ``_cached_measurement``)."""
    import sys

    def say(message: str) -> None:
        print(f"tierspec: {what} of {target.identity.name}: {message}", file=sys.stderr)

    path = cache_root() / f"{prefix}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    reason, cached = "measuring it once", None
    try:
        if path.exists() and not refresh:
            cached = read(path)
            reason = f"the cached file {path.name} is damaged; measuring again"
    except OSError as error:  # an unreadable cache folder: measured as if nothing were cached
        reason = f"the cache is unreadable ({error.strerror}); measuring it"
    if cached is not None:
        table = one_token_seconds(cached)
        checks = []
        for _ in range(SPOT_CHECKS):
            checks.append(spot_check(target.model))
            if _agrees(table, checks[-1]):
                return cached
        if min(checks) > table:
            say(f"a 1-token pass takes {min(checks) * 1000:.0f} ms now, {table * 1000:.0f} ms in the cached file: the "
                "machine is busy; using the cached file")
            return cached
        reason = (f"the cached file says a 1-token pass takes {table * 1000:.0f} ms, it now takes "
                  f"{min(checks) * 1000:.0f} ms (measured on a busy machine?); measuring again")
    say(f"{reason} (cached in {path.parent})")
    measured = measure()
    after = spot_check(target.model)
    if not _agrees(one_token_seconds(measured), after):
        say(f"a 1-token pass took {one_token_seconds(measured) * 1000:.0f} ms while measuring, {after * 1000:.0f} ms "
            "right after: the machine's load changed; this process uses the measurement, no file keeps it")
        return measured
    try:
        atomic_write_text(path, json.dumps({"key": json.loads(key), **to_json(measured)}, indent=2))
    except OSError as error:
        say(f"cannot keep it in {path.parent} ({error.strerror}); this process uses it, the next measures again")
    return measured


# ---- products over a few rows: on one thread or on every thread ----------------------------


#: Passes of 1 .. FEW_ROWS rows are timed with one-thread and with every-thread products.
FEW_ROWS = 2
#: A model whose engine weights take fewer bytes than this keeps the engine's default: its
#: products read weights the CPU's caches hold, where the question (does one thread stream a
#: weight from memory as fast as two?) does not arise, and the tests' tiny models stay unmeasured.
FEW_ROW_MIN_BYTES = 16 << 20
FEW_ROW_PREFIX = "few-row-threads"
#: The models whose few-row threads were settled in this process (measured, read, or left alone).
_SETTLED: "weakref.WeakKeyDictionary[torch.nn.Module, FewRowThreads | None]" = weakref.WeakKeyDictionary()
# One settling at a time: a thread resetting a model's weights to the default while another
# measures them would time the wrong setting.
_SETTLING = threading.Lock()


@dataclass(frozen=True)
class FewRowThreads:
    """Which threads a model's products over a few rows run on, measured on this machine.
    ``one_thread_rows``: products over this many rows or fewer run on one thread (0: every product
    on every thread); ``seconds[rows]``: the median pass over that many rows with (every-thread,
    one-thread) products.

    Why measured: whether one thread streams a one-row product as fast as two is the machine's,
    not its ISA's. On a Zen 5 (AVX-512) one-thread products made 1 / 2-row passes of the default
    model 3.0 / 3.8 ms against 3.6 / 4.0; on a 2-core Zen 4 VM (AVX-512 VNNI) 6.04–6.09 / 6.78–6.92 ms
    against 5.12–5.21 / 5.59–6.05 (this measurement three times, results/zen4/int8/few_row_threads.log);
    on a 2-core Zen 3 VM (AVX2) one thread streamed 12 GB/s, two 22 GB/s."""

    one_thread_rows: int
    seconds: dict[int, tuple[float, float]]


def _engine_weights(model: torch.nn.Module) -> list:
    """The model's engine weights (``quant.QuantWeight``), each once."""
    found = {id(m.qweight): m.qweight for m in model.modules() if hasattr(m, "qweight")}
    return list(found.values())


def set_one_thread_rows(weights: list, rows: int | None) -> None:
    """Products of each of ``weights`` over ``rows`` rows or fewer on one thread (None: the default)."""
    for weight in weights:
        weight.one_thread_rows = rows


def one_thread_rows_from(seconds: dict[int, tuple[float, float]]) -> int:
    """The most rows r such that passes over every count 1 .. r were faster with one-thread
    products than with every-thread ones (0: none was)."""
    chosen = 0
    for rows in sorted(seconds):
        every, one = seconds[rows]
        if rows != chosen + 1 or not one < every:
            break
        chosen = rows
    return chosen


def measure_few_row_threads(model: torch.nn.Module, context: int = TABLE_CONTEXT, rounds: int = 2,
                            passes: int = 4) -> FewRowThreads:
    """Passes of 1 .. ``FEW_ROWS`` rows after ``context`` cached positions, timed in blocks of
    ``passes`` (after one that lets the threads settle) with every-thread and with one-thread
    products in the order A B B A, ``rounds`` times: alternating pass by pass measured a coin flip
    (a worker that one setting keeps awake stays awake into the other's pass), blocks measure each
    setting's own steady state. The weights are left at the engine's default (``few_row_threads``
    spot-checks a measurement under it, then sets the choice)."""
    from .engine import threads_for

    weights = _engine_weights(model)
    runner = measuring_runner(model)
    vocab = runner.vocab_size
    samples: dict[tuple[int, bool], list[float]] = {(r, one): [] for r in range(1, FEW_ROWS + 1) for one in (False, True)}
    with threads_for(model), torch.inference_mode():
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        for one in (False, True, True, False) * rounds:
            set_one_thread_rows(weights, FEW_ROWS if one else 0)
            for rows in range(1, FEW_ROWS + 1):
                tokens = (torch.arange(rows) * 7 + 11) % vocab
                for i in range(passes + 1):
                    started = time.perf_counter()
                    runner.forward(tokens, logits_for=rows)
                    elapsed = time.perf_counter() - started
                    runner.rollback(context)
                    if i:
                        samples[(rows, one)].append(elapsed)
    seconds = {r: (statistics.median(samples[(r, False)]), statistics.median(samples[(r, True)]))
               for r in range(1, FEW_ROWS + 1)}
    set_one_thread_rows(weights, None)
    return FewRowThreads(one_thread_rows_from(seconds), seconds)


def _read_few_row_threads(path: Path) -> FewRowThreads | None:
    try:
        data = json.loads(path.read_text())
        rows = data["one_thread_rows"]
        seconds = {int(r): (float(v[0]), float(v[1])) for r, v in data["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None
    if sorted(seconds) != list(range(1, FEW_ROWS + 1)) or not isinstance(rows, int) or not 0 <= rows <= FEW_ROWS:
        return None
    if not all(math.isfinite(v) and 0 < v < 60 for pair in seconds.values() for v in pair):
        return None
    return FewRowThreads(rows, seconds)


def few_row_threads(target: LoadedModel, refresh: bool = False) -> FewRowThreads | None:
    """Settle which threads ``target``'s products over a few rows run on (``FewRowThreads``):
    measured (80 passes after a 256-token prefill) once per model and machine and cached as ``_cached_measurement``
    says, then set on every engine weight of the model. None where there is nothing to choose: a
    model off the engine, one engine thread, or weights under ``FEW_ROW_MIN_BYTES`` (the engine's
    default stays). The decode loop settles it before a model's first generation, and every other
    pass measurement before it times a pass, so a cost table measures what a generation pays."""
    model = target.model
    if model in _SETTLED and not refresh:
        return _SETTLED[model]
    with _SETTLING:  # a second thread (the server's) waits, then finds it settled
        if model in _SETTLED and not refresh:
            return _SETTLED[model]
        _SETTLED[model] = measured = _settle_few_row_threads(target, refresh)
    return measured


def _settle_few_row_threads(target: LoadedModel, refresh: bool) -> FewRowThreads | None:
    from .engine import engine, engine_threads

    model = target.model
    weights = _engine_weights(model)
    measured = None
    if weights and engine_threads() > 1 and sum(w.nbytes for w in weights) >= FEW_ROW_MIN_BYTES:
        set_one_thread_rows(weights, None)  # measured (and keyed) from the default, which the spot checks run
        default_rows = int(engine().one_thread_rows(weight=weights[0].handle))
        measured = _cached_measurement(
            target, FEW_ROW_PREFIX, "one or every thread for products over 1-2 rows", {"rows": FEW_ROWS},
            _read_few_row_threads, lambda: measure_few_row_threads(model),
            lambda m: {"one_thread_rows": m.one_thread_rows, "seconds": {r: list(v) for r, v in m.seconds.items()}},
            lambda m: m.seconds[1][1 if default_rows >= 1 else 0], refresh)
        set_one_thread_rows(weights, measured.one_thread_rows)
    return measured


# ---- a drafter's step: what one more drafted token costs -------------------------------------


@dataclass(frozen=True)
class DraftStepCost:
    """Seconds of one drafting step (the drafter's model run for one more drafted token and its
    scores read) and of the target's one-token pass, measured in alternation on this machine."""

    step_seconds: float
    one_token_seconds: float

    @property
    def fraction(self) -> float:
        """The step in units of a one-token target pass (``policies.CostModel.draft_fractions``)."""
        return self.step_seconds / self.one_token_seconds


def measure_draft_step(model: torch.nn.Module, step, context: int = TABLE_CONTEXT, repeats: int = 20) -> DraftStepCost:
    """The fastest of ``repeats`` calls of ``step()`` (one drafting step that undoes itself) and the
    fastest of as many one-token passes of ``model`` after ``context`` cached tokens, taken in
    turn: each step right after a target pass, as the loop runs it (the pass has streamed the
    target's weights through the caches the step then reads from)."""
    from .engine import threads_for

    with threads_for(model), torch.inference_mode():
        runner = measuring_runner(model)
        vocab = runner.vocab_size
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        token = torch.tensor([11 % vocab])
        steps, passes = [], []
        for round_ in range(repeats + 1):
            started = time.perf_counter()
            runner.forward(token, logits_for=1)
            passed = time.perf_counter()
            runner.rollback(context)
            step_started = time.perf_counter()
            step()
            ended = time.perf_counter()
            if round_:  # the first round warms both
                passes.append(passed - started)
                steps.append(ended - step_started)
    return DraftStepCost(min(steps), min(passes))


def draft_step_cost(target: LoadedModel, drafter_key: dict, make_step, refresh: bool = False) -> DraftStepCost:
    """``measure_draft_step`` for a drafter of the shape ``drafter_key`` names (what its step's cost
    depends on, not its weights' values) beside ``target`` on this machine: measured once (well
    under a second) and cached as ``_cached_measurement`` says. ``make_step()`` (called only to
    measure) returns the step to time. Why measured and not costed by the weights it reads: a
    step of the default model's draft head reads a tenth of a target pass's bytes and takes a
    sixth of its time on an AVX2 CPU (one layer's fixed costs, the scores over its vocabulary,
    caches the target's pass left cold), and a policy that charged it by its bytes drafted
    where drafting did not pay."""

    def read(path: Path) -> DraftStepCost | None:
        try:
            data = json.loads(path.read_text())
            cost = DraftStepCost(float(data["step_seconds"]), float(data["one_token_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        values = (cost.step_seconds, cost.one_token_seconds)
        return cost if all(math.isfinite(v) and 0 < v < 60 for v in values) else None

    return _cached_measurement(target, "draft-step", "the cost of a draft step", {"drafter": drafter_key}, read,
                               lambda: measure_draft_step(target.model, make_step()), vars,
                               lambda cost: cost.one_token_seconds, refresh)


# ---- per-unit costs: what bypassing an attention or MLP sub-layer saves ----------------------


@dataclass
class UnitCosts:
    """Seconds of a cached 1-token pass and what each kind of unit contributes to it:
    ``attention`` / ``mlp`` per sub-layer (all layers have one shape), ``lm_head`` for the full
    vocabulary. Measured by bypassing every attention (every MLP) sub-layer and differencing,
    so the numbers include the unit's own overheads on this machine, not just its weights."""

    full: float
    attention: float
    mlp: float
    lm_head: float

    def unit_share(self, kind: str) -> float:
        """A unit's share of a full pass (``layer`` = attention + MLP)."""
        seconds = {"attn": self.attention, "mlp": self.mlp, "layer": self.attention + self.mlp}[kind]
        return seconds / self.full

    def bypassed_share(self, mask) -> float:
        """Share of a full 1-token pass that ``mask`` bypasses (its compute-weighted ratio)."""
        if mask is None:
            return 0.0
        return sum(self.unit_share(kind) for kind, _ in mask.bypassed_units())


def _head_input_dtype(head: torch.nn.Module) -> torch.dtype:
    dtype = getattr(head, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else head.weight.dtype


def measure_unit_costs(model: torch.nn.Module, context: int = 256, repeats: int = 15) -> UnitCosts:
    """Interleaved medians of 1-token passes: full, no attention, no MLP, and the LM head alone."""
    from .engine import threads_for

    with threads_for(model):
        return _measure_unit_costs(model, context, repeats)


def _measure_unit_costs(model: torch.nn.Module, context: int, repeats: int) -> UnitCosts:
    from .layerskip.masks import RoutingMask, decoder_layers

    layers = len(decoder_layers(model))
    every = frozenset(range(1, layers - 1))  # the bypassable layers (first and last always run)
    variants = {"full": None, "no_attention": RoutingMask(layers, "sublayer", every, frozenset()),
                "no_mlp": RoutingMask(layers, "sublayer", frozenset(), every)}
    runner = measuring_runner(model)  # an encoder–decoder model's decoder, against a source
    vocab = runner.vocab_size
    head = model.get_output_embeddings()
    hidden = torch.randn(1, model.config.hidden_size, device=runner.device)  # the float32 stream the head reads
    samples: dict[str, list[float]] = {name: [] for name in (*variants, "lm_head")}
    with torch.inference_mode():
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        token = torch.tensor([11 % vocab])
        for i in range(repeats + 2):
            for name, mask in variants.items():
                started = time.perf_counter()
                runner.forward(token, logits_for=1, mask=mask)
                elapsed = time.perf_counter() - started
                runner.rollback(context)
                if i >= 2:
                    samples[name].append(elapsed)
            started = time.perf_counter()
            head(hidden.to(_head_input_dtype(head))).float().cpu()
            if i >= 2:
                samples["lm_head"].append(time.perf_counter() - started)
    median = {name: statistics.median(values) for name, values in samples.items()}
    count = len(every)
    return UnitCosts(full=median["full"], attention=max(median["full"] - median["no_attention"], 0.0) / count,
                     mlp=max(median["full"] - median["no_mlp"], 0.0) / count, lm_head=median["lm_head"])


def unit_costs(target: LoadedModel, refresh: bool = False) -> UnitCosts:
    """The per-unit costs for this model on this machine (measured once, a few seconds, and
    cached; re-measured as ``_cached_measurement`` says)."""

    def read(path: Path) -> UnitCosts | None:
        try:
            data = json.loads(path.read_text())
            costs = UnitCosts(**{k: float(data["costs"][k]) for k in ("full", "attention", "mlp", "lm_head")})
        except (OSError, ValueError, KeyError, TypeError):
            return None
        valid = all(math.isfinite(v) and 0 <= v < 60 for v in vars(costs).values()) and costs.full > 0
        return costs if valid else None

    return _cached_measurement(target, "unit-costs", "per-unit costs", {}, read, lambda: measure_unit_costs(target.model),
                               lambda costs: {"costs": vars(costs)}, lambda costs: costs.full, refresh)


# ---- tree passes: what one more attention call costs ------------------------------------------


def _attention_calls(attends: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor, start: int) -> int:
    """Attention calls per layer of a cached pass with the tree mask ``attends`` (``llama.tree_attention_plan``)."""
    from .llama import ATTENTION_ROWS, KEY_BLOCK, tree_attention_plan

    keys = -(-(start + len(tokens)) // KEY_BLOCK) * KEY_BLOCK
    plan = tree_attention_plan(attends, tokens, start + offsets, start, keys, torch.float32, torch.device("cpu"))
    return sum(int(group.rows.shape[0]) // ATTENTION_ROWS for group in plan.groups)


def measure_tree_call_seconds(model: torch.nn.Module, context: int = 256, repeats: int = 7) -> float:
    """Seconds one more attention call adds to a pass: interleaved medians of a 16-token chain pass
    and a 16-token tree pass (1 pending token, 8 children of the root, 7 of them with one child:
    8 root-to-leaf paths), their difference over the difference of their attention calls. (On the
    pass engine a tree attends in no extra calls: this measures the little a tree pass still adds.)"""
    from .engine import threads_for

    with threads_for(model):
        return _measure_tree_call_seconds(model, context, repeats)


def _measure_tree_call_seconds(model: torch.nn.Module, context: int, repeats: int) -> float:
    from .llama import ATTENTION_ROWS
    from .tree import TokenTree, tree_pass

    runner = CachedModel(model)
    vocab = runner.vocab_size
    tree = TokenTree(torch.tensor([(7 * i + 11) % vocab for i in range(15)]),
                     torch.tensor([-1] * 8 + list(range(7))))
    layout = tree_pass(torch.tensor([5 % vocab]), tree)
    chain = (torch.arange(16) * 7 + 11) % vocab
    extra = _attention_calls(layout.attends, layout.tokens, layout.offsets, context) - -(-16 // ATTENTION_ROWS)
    samples: dict[str, list[float]] = {"chain": [], "tree": []}
    with torch.inference_mode():
        runner.forward(torch.arange(context) % vocab, logits_for=1)
        for i in range(repeats + 1):
            for name in samples:
                started = time.perf_counter()
                if name == "chain":
                    runner.forward(chain, logits_for=16)
                else:
                    runner.forward(layout.tokens, logits_for=16, offsets=layout.offsets, attends=layout.attends)
                elapsed = time.perf_counter() - started
                runner.rollback(context)
                if i:
                    samples[name].append(elapsed)
    difference = statistics.median(samples["tree"]) - statistics.median(samples["chain"])
    return max(difference, 0.0) / max(extra, 1)


def tree_call_seconds(target: LoadedModel, refresh: bool = False) -> float:
    """``measure_tree_call_seconds`` for this model on this machine (a second to measure, cached and
    re-measured as ``_cached_measurement`` says; its spot check is the 1-token pass it was measured
    beside)."""

    def read(path: Path) -> tuple[float, float] | None:
        try:
            data = json.loads(path.read_text())
            values = (float(data["call_seconds"]), float(data["one_token_seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return values if all(math.isfinite(v) and 0 <= v < 60 for v in values) and values[1] > 0 else None

    def measure() -> tuple[float, float]:
        return measure_tree_call_seconds(target.model), spot_check(target.model)

    measured = _cached_measurement(target, "tree-call", "the cost of a tree pass's extra attention call", {}, read,
                                   measure, lambda m: {"call_seconds": m[0], "one_token_seconds": m[1]},
                                   lambda m: m[1], refresh)
    return measured[0]
