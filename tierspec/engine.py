"""The binding to tierspec's compiled pass engine (``tierspec/csrc/qengine.c``, the extension
``tierspec._qengine``) and the threads it runs on: the lowest layer the engine's users share
(``tierspec.llama`` runs decoder layers through it; ``tierspec.quant`` builds weights for it).
docs/algorithms.md §The pass engine says what it computes.

Why a compiled extension of the project's own and not a maintained engine: every maintained path
was measured on the same cached passes first (``benchmarks/engine_candidates.py``; the table is in
BENCHMARKS.md, "The pass engine"): torch's int4/int8 weight packs on tierspec's forward,
torch.compile/inductor (defaults, freezing, cpp_wrapper, dynamic shapes, max-autotune, over the int4
pack), AOTInductor packages and OpenVINO's CPU plugin (f32, bf16, nncf int8/int4). None reached
llama.cpp's one-token pass (the nearest, inductor over the int4 pack, cost 1.6× the engine's at one
token and 1.8× at sixteen); none computes with exactly the file's values; and the compiled graphs
are not row-independent (a token's logits moved by 0.3 to 1.3 with the rows beside it, which would
break the batch's and the seed's guarantees), need a graph per routing mask and start in 37–130 s
from their caches. The engine is the fastest at every width, bitwise row-independent, keeps routing
masks, any layer's hidden states and token trees, and starts in 1.5 s.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .errors import ModelLoadError


class EngineMissingError(ModelLoadError):
    """tierspec's compiled pass engine is not importable (a source checkout not built)."""


@functools.lru_cache(maxsize=None)
def engine():
    """The compiled engine module ``tierspec._qengine``, or a one-line error saying how to build it."""
    try:
        from . import _qengine
    except ImportError as error:
        raise EngineMissingError(f"tierspec's compiled pass engine is missing ({error}); build it with README's "
                                 "install command (pip install -e '.[test,llamacpp]')") from None
    return _qengine


def engine_available() -> bool:
    try:
        engine()
    except EngineMissingError:
        return False
    return True


_ENGINE_THREADS: int | None = None  # set by ``torch_ops_on_one_thread`` while a generation runs


def engine_threads() -> int:
    """Threads the engine runs on: torch's intra-op count as the caller set it (the user's thread
    budget), also while ``torch_ops_on_one_thread`` has torch's own operators on one."""
    return _ENGINE_THREADS if _ENGINE_THREADS is not None else torch.get_num_threads()


def runs_on_engine(model: torch.nn.Module) -> bool:
    """Whether ``model``'s decoder runs as engine calls (a GGUF model loaded on its blocks)."""
    get_decoder = getattr(model, "get_decoder", None)
    return get_decoder is not None and getattr(get_decoder(), "engine_stack", None) is not None


def threads_for(model: torch.nn.Module):
    """The thread arrangement a model's passes and loop run under: ``torch_ops_on_one_thread`` on
    the engine, torch's as set otherwise. Generations and pass-cost measurements both use it, so a
    cost table measures what a generation pays."""
    return torch_ops_on_one_thread() if runs_on_engine(model) else contextlib.nullcontext()


@contextlib.contextmanager
def torch_ops_on_one_thread():
    """Within the block torch's own operators run on the calling thread alone, while the engine keeps
    the caller's thread count. Why: the decode loop's torch operators are small (rows of logits, a
    norm), and torch's intra-op pool splits a 49,152-wide row across threads that meet at a barrier:
    on a busy machine (another process on the other core) an 8x8 ``triu`` measured 7.8 ms with two
    threads and 4 µs with one, where the engine's own pool shares its work without waiting for a
    thread the OS has not scheduled. The previous setting is restored on leaving (also between the
    steps a stream hands out), so code around a generation keeps its threads."""
    global _ENGINE_THREADS
    previous, outer = torch.get_num_threads(), _ENGINE_THREADS
    _ENGINE_THREADS = outer if outer is not None else previous
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
        _ENGINE_THREADS = outer
