"""The binding to tierspec's compiled pass engine (``tierspec/csrc``, the extension
``tierspec._qengine``) and the threads it runs on: the lowest layer the engine's users share
(``tierspec.llama`` runs decoder layers through it; ``tierspec.quant`` builds weights for it).
docs/engine.md says what it computes, on which kernel paths, and how the CPU is probed.

The Python-level API: ``engine()`` (the module: weights, layers and stacks as capsules, calls with
named arguments), ``run_stack`` (a pass over a range of a stack's layers for a list of ``Segment``
sequences, torch tensors checked here), ``kernel_path`` / ``probe`` / ``kernel_report`` (which kernels
run here and why), and the thread arrangement (``engine_threads``, ``torch_ops_on_one_thread``).

Why a compiled extension of the project's own and not a maintained engine: every maintained path
was measured on the same cached passes first (``benchmarks/engine_candidates.py``; the table is in
docs/history.md, "Zen 5: the pass engine against every candidate"): torch's int4/int8 weight packs on tierspec's forward,
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

import array
import contextlib
import functools
from typing import NamedTuple, Sequence

import torch

from .errors import ModelLoadError
from .sampling import share_rows_among


class EngineMissingError(ModelLoadError):
    """tierspec's compiled pass engine is not importable (a source checkout not built)."""


class EngineSettingError(ModelLoadError):
    """The engine's environment setting is wrong (an unknown ``TIERSPEC_ENGINE_ISA``)."""


@functools.lru_cache(maxsize=None)
def engine():
    """The compiled engine module ``tierspec._qengine``, or a one-line error saying how to build it
    (or what is wrong with ``TIERSPEC_ENGINE_ISA``, which the engine reads at import)."""
    try:
        from . import _qengine
    except ImportError as error:
        raise EngineMissingError(f"tierspec's compiled pass engine is missing ({error}); build it with README's "
                                 "install command (pip install -e '.[test,llamacpp]')") from None
    except ValueError as error:  # the engine refused TIERSPEC_ENGINE_ISA
        raise EngineSettingError(str(error)) from None
    return _qengine


def engine_available() -> bool:
    try:
        engine()
    except EngineMissingError:
        return False
    return True


def kernel_path() -> str:
    """The kernel path the engine uses: portable, avx2, avx512, avx512vnni, avx512bf16 or amx."""
    return engine().isa()


def probe() -> dict:
    """What the engine found at import: ``isa`` (the path in use), ``best`` (the most this CPU and
    OS run), ``cap`` (``TIERSPEC_ENGINE_ISA`` or None), ``features`` (CPUID's and the OS's flags),
    ``amx`` and ``amx_reason`` (why AMX is not used: not listed, not granted by Linux, or its probe
    child killed by a tile instruction), ``paths``: the path each kernel takes per numerics, and
    ``pass_rows``: the rows per chunk of a long pass (a prefill runs through every layer a chunk at a
    time; the AMX path takes larger chunks, which its tiles amortise their weights' setup over)."""
    return engine().probe()


def kernel_report() -> str:
    """One line for ``--stats`` and ``/health``: the path in use, the numerics' kernels and AMX's
    state, e.g. "engine kernels avx512vnni (int8 rows: avx512vnni, float32 rows: avx512, bfloat16
    rows: portable); AMX not used: this CPU's CPUID lists no AMX (tiles with BF16 and INT8)"."""
    found = probe()
    paths = found["paths"]
    text = (f"engine kernels {found['isa']} (int8 rows: {paths['int8']}, float32 rows: {paths['float32']}, "
            f"bfloat16 rows: {paths['bfloat16']})")
    if found["cap"] is not None:
        text += f", capped by TIERSPEC_ENGINE_ISA={found['cap']}"
    return text + ("; AMX in use" if found["amx"] else f"; AMX not used: {found['amx_reason']}")


class Segment(NamedTuple):
    """One sequence's rows of an engine pass: ``rows`` new rows (from row ``first_row`` of the
    pass) written at cache slots ``start ..``; ``kv_table`` int64 [layers, 4]: each layer's key and
    value buffer addresses, capacity and element size, 4 or 2 bytes: float32 or float16
    (``llama.KVLayer.engine_row``); ``attends`` uint8 (None: a
    chain): [rows, rows] among the new rows, or [rows, start + rows] over every slot when
    ``every_slot`` (the draft head's token trees); ``positions`` int64 [rows]: each row's position
    (None: start, start + 1, …, a chain's), which sliding-window layers read (a tree's nodes see the
    keys of the last ``window`` positions before their own)."""

    first_row: int
    rows: int
    start: int
    kv_table: torch.Tensor
    attends: torch.Tensor | None = None
    every_slot: bool = False
    positions: torch.Tensor | None = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · ``weight`` over the last dimension of float32 CPU rows ``x`` [..., W] contiguous
    (``weight`` float32 [W]), by the norm kernel the engine's layers run: a new tensor. Why: a
    model's final norm after the stack call is one engine call, where torch's composite rms_norm
    runs five operators, each cold in the caches once a pass has streamed the weights (a one-row
    pass of the default model 7.14 → 7.04 ms on a Zen 4, BENCHMARKS.md at 97367ab). A ValueError for other
    dtypes or shapes, before anything runs."""
    width = int(x.shape[-1])
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"the engine's norm reads {name} as contiguous float32 on the CPU")
    if tuple(weight.shape) != (width,):
        raise ValueError(f"a norm over {width} values needs a weight [{width}], not {tuple(weight.shape)}")
    out = torch.empty_like(x)
    engine().rms_norm(x=x.data_ptr(), weight=weight.data_ptr(), out=out.data_ptr(), rows=x.numel() // width,
                      width=width, eps=float(eps))
    return out


def run_stack(stack, hidden: torch.Tensor, out: torch.Tensor, segments: list[Segment],
              rotary: Sequence[tuple[torch.Tensor, torch.Tensor]], flags: bytes, first: int = 0,
              last: int | None = None, threads: int | None = None,
              captures: dict[int, torch.Tensor] | None = None) -> None:
    """Layers ``first .. last - 1`` of ``stack`` (a ``make_stack`` capsule) over the pass's rows:
    ``hidden`` and ``out`` float32 [rows, H] contiguous (out: the last layer's output); ``rotary``
    the pass's rotary tables (one per layer kind, each layer reads its own: Gemma 3's local and
    global), each a (cos, sin) pair float32 [rows, rotary_dims] (x·cos + roll(x, rotary_dims/2)·sin
    rotates a head's first rotary_dims by each row's position); ``flags`` one byte per layer of the
    stack (1 attention, 2 MLP, 0 skipped). A solo pass is one segment; a batch's sequences share the
    products and each attends over its own cache. ``captures``: {layer: float32 [rows, H]
    contiguous} receiving the residual rows after each of those layers (``first`` ≤ layer < ``last``;
    the same rows a call ending at that layer would write to ``out``): hidden states captured inside
    the one call. Bad shapes are a ValueError before anything runs."""
    rows = int(hidden.shape[-2])
    for name, tensor in (("hidden", hidden), ("out", out)) + tuple(
            (f"rotary table {i}", part) for i, pair in enumerate(rotary) for part in pair):
        if tensor.dtype != torch.float32 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"the engine reads {name} as contiguous float32 on the CPU")
    if out.shape != hidden.shape or hidden.numel() != rows * int(hidden.shape[-1]):
        raise ValueError(f"hidden {tuple(hidden.shape)} and out {tuple(out.shape)} must be the same [rows, H]")
    if not rotary:
        raise ValueError("a pass needs one rotary table at least")
    width = int(rotary[0][0].numel()) // rows
    for cos, sin in rotary:
        if cos.numel() != rows * width or sin.numel() != rows * width:
            raise ValueError(f"each rotary table holds one row of {width} factors per pass row ({rows}), "
                             f"not cos {tuple(cos.shape)} and sin {tuple(sin.shape)}")
    last = len(flags) if last is None else last
    table = []
    for segment in segments:
        kv = segment.kv_table
        if kv.dtype != torch.int64 or kv.dim() != 2 or kv.shape[1] != 4 or not kv.is_contiguous() or kv.shape[0] < last:
            raise ValueError(f"a segment's KV table is int64 [layers, 4] contiguous, a row for each of the stack's "
                             f"first {last} layers, not {tuple(kv.shape)}")
        attends = positions = 0
        if segment.attends is not None:
            mask, keys = segment.attends, segment.start + segment.rows if segment.every_slot else segment.rows
            if mask.dtype != torch.uint8 or not mask.is_contiguous() or tuple(mask.shape) != (segment.rows, keys):
                raise ValueError(f"a segment's attends is uint8 [{segment.rows}, {keys}] contiguous, "
                                 f"not {tuple(mask.shape)}")
            attends = mask.data_ptr()
        if segment.positions is not None:
            given = segment.positions
            if given.dtype != torch.int64 or not given.is_contiguous() or given.device.type != "cpu" \
                    or given.numel() != segment.rows:
                raise ValueError(f"a segment's positions are int64 [{segment.rows}] contiguous on the CPU, "
                                 f"not {given.dtype} {tuple(given.shape)}")
            positions = given.data_ptr()
        table.append((segment.first_row, segment.rows, segment.start, kv.data_ptr(), attends, int(segment.every_slot),
                      positions))
    # The segment and capture tables as int64 arrays of Python's own (``array``), not tensors: a
    # tensor made and written from Python is a few torch operators a pass, each cold after the
    # weights' stream (a tensor of 3 ints made 35–41 µs, an array of them 10–11, right after a
    # one-row pass on a Zen 4: benchmarks/torch_calls.py).
    described = array.array("q", [value for row in table for value in row])
    capture_table = None
    if captures:
        capture_table = array.array("q", bytes(8 * len(flags)))
        for layer, buffer in captures.items():
            if not first <= layer < last:
                raise ValueError(f"layer {layer} is outside the call's layers {first} .. {last - 1}")
            if buffer.dtype != torch.float32 or not buffer.is_contiguous() or buffer.device.type != "cpu" \
                    or buffer.shape != hidden.shape:
                raise ValueError(f"layer {layer}'s capture must be contiguous float32 {tuple(hidden.shape)} on the CPU, "
                                 f"not {buffer.dtype} {tuple(buffer.shape)}")
            capture_table[layer] = buffer.data_ptr()
    engine().run_stack(stack=stack, first=first, last=last, hidden=hidden.data_ptr(), out=out.data_ptr(), rows=rows,
                       rotary=tuple((cos.data_ptr(), sin.data_ptr()) for cos, sin in rotary), rotary_dims=width,
                       segments=described.buffer_info()[0], count=len(table), flags=flags,
                       threads=engine_threads() if threads is None else threads,
                       captures=None if capture_table is None else capture_table.buffer_info()[0])


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


def torch_ops_on_one_thread() -> TorchOpsOnOneThread:
    """Within the block torch's own operators run on the calling thread alone, while the engine keeps
    the caller's thread count. Why: the decode loop's torch operators are small (rows of logits, a
    norm), and torch's intra-op pool splits a 49,152-wide row across threads that meet at a barrier:
    on a busy machine (another process on the other core) an 8x8 ``triu`` measured 7.8 ms with two
    threads and 4 µs with one, where the engine's own pool shares its work without waiting for a
    thread the OS has not scheduled. The previous setting is restored on leaving (also between the
    steps a stream hands out), so code around a generation keeps its threads."""
    return TorchOpsOnOneThread()


class TorchOpsOnOneThread:
    """``torch_ops_on_one_thread``'s block, made once and entered as often as needed (a generation
    enters it at every step it hands out: a class, not a generator, so entering it makes no
    generator object; nested entries restore in turn)."""

    __slots__ = ("_saved",)

    def __init__(self):
        self._saved: list[tuple[int, int | None, int]] = []

    def __enter__(self) -> TorchOpsOnOneThread:
        global _ENGINE_THREADS
        previous, outer = torch.get_num_threads(), _ENGINE_THREADS
        _ENGINE_THREADS = outer if outer is not None else previous
        torch.set_num_threads(1)
        # the sampled tokens of many rows: the engine's threads
        self._saved.append((previous, outer, share_rows_among(_ENGINE_THREADS)))
        return self

    def __exit__(self, *exc) -> bool:
        global _ENGINE_THREADS
        previous, outer, rows_before = self._saved.pop()
        torch.set_num_threads(previous)
        share_rows_among(rows_before)
        _ENGINE_THREADS = outer
        return False
