"""Each llama.cpp and OpenVINO peer of a bench run in a worker process of its own.

Both are native libraries that can die with a signal the bench cannot catch: the llama.cpp that a
``-march=native`` build gives an Intel Xeon with AMX died with SIGILL in its AMX code on every pass
of 4 or more tokens, and took ``tierspec bench`` with it. In a worker process such a death ends
that peer only: the parent sees the worker gone (``PeerFailed``, the signal named), the bench
writes that peer's error records and the rest of the run goes on and is summarised.

Timing stays what it was: the peer's clock runs inside the worker around its own generation, as
in the bench's process before; the records carry the worker's peak memory (the bench's process no
longer holds the peer's model). What the boundary adds — sending the prompt ids and receiving the
tokens, outside the clock — is each record's ``worker_round_trip_seconds`` (the parent's wall time
of the call minus the worker's clock).

A worker is started with ``spawn`` (a fresh interpreter: forking a process that holds torch's and
OpenMP's threads is unsafe) and answers one request at a time over a pipe.
"""

from __future__ import annotations

import importlib
import multiprocessing
import signal
import time
import weakref
from dataclasses import dataclass

import torch

from ..errors import TierspecError
from .memory import PeakRSS
from .outcome import Outcome

# How long one generation may take before the worker is taken for hung and killed.
GENERATION_TIMEOUT_SECONDS = 1800.0
# How long a worker may take to load its model (OpenVINO compiles it for this CPU then).
START_TIMEOUT_SECONDS = 600.0
# What a SIGILL in a llama.cpp peer means and how to mend it (README's install builds llama.cpp so).
SIGILL_HINT = ("the library executed an instruction this CPU (or its VM) does not run — a build for another CPU, or "
               "llama.cpp's AMX code on a VM that hides AMX; rebuild it without AMX: CMAKE_ARGS=\"-DCMAKE_C_FLAGS="
               "'-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 "
               "-mno-amx-bf16'\" pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python==0.3.36")


class PeerFailed(TierspecError):
    """A peer could not give this generation: its worker died (the signal named), hung, or raised."""


def prompt_seed(temperature: float, run_seed: int, generator: torch.Generator | None) -> int | None:
    """The seed a peer samples a prompt with: drawn from the bench's per-prompt generator (as the
    hf-* peers draw theirs), the run's seed without one, None in greedy mode."""
    if temperature == 0:
        return None
    return run_seed if generator is None else int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


def death_reason(name: str, exitcode: int | None, doing: str) -> str:
    """One line: which peer's worker died how, while doing what (with the mend for SIGILL)."""
    if exitcode is not None and exitcode < 0:
        number = -exitcode
        try:
            label = f"{signal.Signals(number).name} ({signal.strsignal(number)})"
        except ValueError:
            label = f"signal {number}"
        reason = f"{name}'s worker process died with {label} while {doing}"
        if number == signal.SIGILL and name.startswith("llamacpp"):
            reason += f": {SIGILL_HINT}"
        return reason
    return f"{name}'s worker process ended (exit status {exitcode}) while {doing}"


@dataclass(frozen=True)
class PeerSpec:
    """What a worker builds its peer from: the peer class (``module:Class``) and its arguments."""

    factory: str
    name: str
    params: dict
    target_spec: str
    vocab_size: int
    eos: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    threads: int

    def peer_class(self):
        return peer_class(self.factory)


def peer_class(factory: str):
    """The peer class a factory string (``module:Class``) names."""
    module, _, qualname = factory.partition(":")
    return getattr(importlib.import_module(module), qualname)


class PeerProcess:
    """A peer (``LlamaCppPeer``, ``OpenVinoPeer``) in a worker process, with the peer's ``run``
    interface: ``run(prompt_ids, max_new_tokens, generator) → Outcome``. A worker that dies makes
    this call and every later one raise ``PeerFailed`` with the reason."""

    def __init__(self, spec: PeerSpec, device: str, run_seed: int):
        """Refuses what can be refused in this process first (the peer's ``check``: package,
        parameters, device, GGUF file), then starts the worker and waits for its model to load; a
        ``TierspecError`` the peer raises there is raised here as it is (a setting to fix)."""
        self.spec, self.name, self.run_seed = spec, spec.name, run_seed
        peer = spec.peer_class()
        peer.check(spec.name, spec.params, spec.target_spec, device)
        self.takes_json_schema: bool = getattr(peer, "takes_json_schema", False)  # ``run``'s ``schema``
        self.failure: str | None = None
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, spec), name=f"tierspec-peer-{spec.name}", daemon=True)
        self.process.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop, self.process, self.connection)
        try:
            kind, value = self._answer(START_TIMEOUT_SECONDS, "loading its model")
        except PeerFailed:
            return  # the worker died loading: ``failure`` says how, and every run raises it
        if kind == "error":
            self.close()
            raise value

    def run(self, prompt_ids: torch.Tensor, max_new_tokens: int, generator: torch.Generator | None,
            schema: str | None = None) -> Outcome:
        """``schema``: the JSON schema (its text) the text follows, for a peer that ``takes_json_schema``."""
        if schema is not None and not self.takes_json_schema:
            raise PeerFailed(f"{self.name} cannot constrain its text to a JSON schema")
        if self.failure is not None:
            raise PeerFailed(f"not run: {self.failure}")
        seed = prompt_seed(self.spec.temperature, self.run_seed, generator)
        started = time.perf_counter()
        self.connection.send(("run", [int(t) for t in prompt_ids], int(max_new_tokens), seed, schema))
        kind, value = self._answer(GENERATION_TIMEOUT_SECONDS, "generating")
        if kind == "error":
            raise PeerFailed(f"{self.name}: {value}")
        value.record_fields["worker_round_trip_seconds"] = round(time.perf_counter() - started - value.seconds, 6)
        return value

    def _answer(self, timeout: float, doing: str):
        """The worker's reply ("ok"/"ready", value) or ("error", exception); a worker that dies or
        does not answer in ``timeout`` seconds is this peer's failure from now on."""
        try:
            if self.connection.poll(timeout):
                return self.connection.recv()
            reason = f"{self.name}'s worker process did not answer in {timeout:.0f} s while {doing} (killed)"
        except (EOFError, OSError):
            self.process.join(5)
            reason = death_reason(self.name, self.process.exitcode, doing)
        self.failure = reason
        self.close()
        raise PeerFailed(reason)

    def close(self) -> None:
        self._finalizer()


def _stop(process, connection) -> None:
    """End a worker: ask it to close its model, then kill it if it does not go."""
    try:
        connection.send(("close",))
    except (OSError, ValueError):
        pass
    process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    connection.close()


def _serve(connection, spec: PeerSpec) -> None:
    """The worker: build the peer, then answer run requests until told to close."""
    try:
        peer = spec.peer_class()(spec.name, spec.params, spec.target_spec, spec.vocab_size, spec.eos,
                                 spec.temperature, spec.top_k, spec.top_p, spec.threads)
    except Exception as error:  # noqa: BLE001 - sent to the parent as the peer's error
        connection.send(("error", _portable(error)))
        return
    torch.set_num_threads(spec.threads)  # what the peer's own threads compete with: the same count as before
    connection.send(("ready", None))
    while True:
        try:
            request = connection.recv()
        except EOFError:  # the bench went away
            break
        if request[0] == "close":
            break
        _, prompt_ids, max_new_tokens, seed, schema = request
        try:
            with PeakRSS() as memory:
                outcome = peer.run(prompt_ids, max_new_tokens, seed) if schema is None else \
                    peer.run(prompt_ids, max_new_tokens, seed, schema)
            outcome.record_fields["peak_rss_mb"] = round(memory.peak, 1)  # the worker's: it holds the model
            connection.send(("ok", outcome))
        except Exception as error:  # noqa: BLE001 - this generation's error; the worker goes on
            connection.send(("error", _portable(error)))
    peer.close()


def _portable(error: Exception) -> Exception:
    """``error`` as it can cross the pipe: a TierspecError as it is, anything else as its words."""
    if isinstance(error, TierspecError):
        return error
    first = next(iter(str(error).strip().splitlines()), "")
    return TierspecError(f"{type(error).__name__}: {first}" if first else type(error).__name__)
