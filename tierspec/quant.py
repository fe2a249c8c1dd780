"""Linear layers and an embedding that compute with a GGUF file's own quantised blocks.

A GGUF file stores most of a model's weights in blocks of 32: Q4_1 as 4-bit values q with the
block's fp16 scale d and minimum m (w = d·q + m), Q4_0 as w = d·(q − 8), Q8_0 as 8-bit values with
a scale (w = d·q). De-quantising them into bfloat16 copies (what tierspec did before) streams 3.4×
the file's bytes per pass and rounds the weights again (d·q + m does not fit bfloat16's 8-bit
significand). Here the blocks are kept, repacked once at load into the layout of tierspec's pass
engine (``tierspec/csrc``: tiles of 16 output rows, the same values), and every product
de-quantises a weight tile once for all the rows of its pass, so a pass over 1–16 new tokens costs
about what one costs.

How the products round (``Numerics``): with native bfloat16 products (AVX512-BF16) the rows are
rounded to bfloat16 and each block's Σ q·x is summed in float32 before its scale is applied — the
weights themselves exact; elsewhere, or with ``dtype=float32``, the rows stay float32 and the
products are float32 FMAs with the exact weights (bfloat16 asked for on such a CPU rounds the rows
first: emulated). Outputs are float32 either way, and a row's result never depends on the other
rows of its pass (every output is summed in an order fixed by the weight's shape).

Native: Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (their super-blocks of 256 kept with the
file's integer sub-scales: ``tierspec/csrc/blocks.h``). A product may stack parts of different native
types (a Q4_K_M layer's q/k in Q4_K, v in Q6_K: ``QuantWeight``'s ``parts``). Other types (F16, BF16,
Q5_1, …) are de-quantised to float, and the load says so in one line.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .engine import engine, engine_threads, probe
from .errors import ModelLoadError

# ggml type ids (ggml.h) of the natively computed block types
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# (inputs, bytes) per file block
_BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
BLOCK = 32
LAYOUT_BFLOAT16_DOT, LAYOUT_FLOAT32_FMA, LAYOUT_INT8_DOT = 0, 1, 2
# The engine's kernels' generation: bumped when a kernel's speed or order of sums changes, so that a
# cached pass-cost table of older kernels is not read (``kernel_key``). 2: tierspec/csrc split by
# role, float32 rows in 16 lanes and four chains, int8 rows on VNNI without AVX512-BF16, AMX.
# 3: K-quant cells, kernels specialised per cell kind. 4: int8 rows on AVX2 (vpmaddubsw), attention
# over a kv head's group of query heads, AVX2 products over 1-2 rows on every thread. 5: float16
# KV caches (``Numerics.kv_dtype``), one-row attention over whole groups of query heads. 6: a long
# pass's chain rows attend in blocks, each block's keys and values widened once (AVX2, AVX-512).
ENGINE_KERNELS = 6


@dataclass(frozen=True)
class Numerics:
    """How a quantised layer's products round: ``layout`` (the engine's kernels: bfloat16 dot
    products, float32 FMAs or int8 dot products) and ``round_rows`` (float32 FMAs on rows rounded to
    bfloat16 values: bfloat16 emulated). ``dtype`` is what the user asked for (or ``auto`` chose).
    ``kv_dtype``: the element type of the KV caches the engine's layers of these numerics make
    (``gguf_llama.FusedLayer``): float16 for ``auto`` (``default_numerics``), float32 for a dtype
    asked for by name (the file's model computed as asked, its cache as the torch layers keep it)."""

    dtype: torch.dtype
    layout: int
    round_rows: bool
    kv_dtype: torch.dtype = torch.float32

    @property
    def description(self) -> str:
        """What the products compute and on which kernel path here (``kernel_key``)."""
        if self.layout == LAYOUT_INT8_DOT:
            what = "8-bit rows per block of 32, int32 sums"
        elif self.layout == LAYOUT_BFLOAT16_DOT:
            what = "bfloat16 rows, float32 sums"
        else:
            what = "bfloat16 rows emulated on float32 FMAs" if self.round_rows else "float32 rows, float32 FMAs"
        return f"{what} ({kernel_key(self).rsplit(':', 1)[1]} kernels)"


def default_numerics() -> Numerics:
    """What ``--dtype auto`` computes with on the engine: int8 rows wherever the CPU has an int8
    dot-product kernel (AVX2's vpmaddubsw, AVX512-VNNI, AMX-INT8: every x86-64 CPU with AVX2), float32
    rows on the portable path. The fidelity target: NLL of greedy ``ar``'s text under the float32
    model of the file's values within +4% (``benchmarks/engine_fidelity.py``).

    int8 rows are llama.cpp's numerics (each block of 32 row values rounded to 8 bits with its own
    scale, exact int32 sums: the same bits on every path). On 72 prompts their NLL was −3.02% of the
    reference's own (95% interval over prompts −9.0% .. +2.9%; teacher-forced KL to the reference
    0.0023 nats a token, the same argmax at 97.8% of positions; results/zen3/engine_fidelity-72). An
    earlier 24-prompt run read +4.69%: on 24 prompts that column's 95% interval spans about 15 points
    (−1.9% .. +13.2% there; bfloat16 rows' +3.86% spanned −0.1% .. +10.6%), so only a larger sample
    can place int8 beside the target. They make a one-row pass 1.4× and a 16-row pass 2.1× faster
    than float32 rows on AVX2 (results/zen3/pass_cost), and on VNNI and AMX run twice the
    multiply-adds per instruction of bfloat16 rows. ``--dtype float32`` keeps the file's model up to
    the order of float32 sums (+0.00%); ``--dtype bfloat16`` rounds rows to bfloat16.

    Its KV caches are float16 (engine.h ``half_from_float``: rounded once when written, widened
    exactly when read): half the bytes a pass's attention reads (a one-row pass of the default model
    0.95× float32 caches' at 300 cached tokens, 0.86× at 1,000 on a Zen 4;
    results/zen4/int8/kv_half.log). On float32 rows the logits move by about 3e-4 of their scale
    (0.01 at a scale of 30); on int8 rows that shift re-rounds some rows' 8-bit blocks, which moves
    them as far as any other change of their sums would (docs/algorithms.md §The pass engine)."""
    rows = numerics_for(torch.int8) if probe()["paths"]["int8"] != "portable" else numerics_for(torch.float32)
    return replace(rows, kv_dtype=torch.float16)


def kernel_key(numerics: Numerics) -> str:
    """Which kernels a weight of ``numerics`` runs on here (its layout, row rounding and the path
    of that layout's kernel, and the engine's kernel generation), for caches whose contents depend
    on them: the pass-cost table (``costs``) is re-measured when any of it changes."""
    path = probe()["paths"][{LAYOUT_BFLOAT16_DOT: "bfloat16", LAYOUT_FLOAT32_FMA: "float32",
                             LAYOUT_INT8_DOT: "int8"}[numerics.layout]]
    rounded = "-rounded" if numerics.round_rows else ""
    half_kv = "-kv16" if numerics.kv_dtype == torch.float16 else ""
    return f"engine-{ENGINE_KERNELS}:layout{numerics.layout}{rounded}{half_kv}:{path}"


def numerics_for(dtype: torch.dtype) -> Numerics:
    """bfloat16: native dot products where the CPU has them (AVX512-BF16), else emulated;
    float32: float32 FMAs; int8: each block of 32 row values rounded to 8 bits with its own scale,
    as llama.cpp rounds activations (int32 dot products on AVX512-VNNI, the same integers and the same
    float steps in portable loops elsewhere). Other dtypes are refused (the outputs are float32)."""
    if dtype == torch.bfloat16:
        native = probe()["paths"]["bfloat16"] in ("avx512bf16", "amx")
        return Numerics(dtype, LAYOUT_BFLOAT16_DOT if native else LAYOUT_FLOAT32_FMA, not native)
    if dtype == torch.float32:
        return Numerics(dtype, LAYOUT_FLOAT32_FMA, False)
    if dtype == torch.int8:
        return Numerics(dtype, LAYOUT_INT8_DOT, False)
    raise ModelLoadError(f"GGUF kernels compute with bfloat16, float32 or int8 rows, not {dtype}; use --dtype auto, "
                         "bfloat16, float32 or int8")


class QuantWeight:
    """A [N, K] weight of native GGUF types, repacked for the engine (``handle``: the engine's weight,
    which owns its cells). ``ggml_type``: its type, or a tuple of its parts' types where they differ."""

    def __init__(self, rows, ggml_type: int, in_features: int, numerics: Numerics, parts: list | None = None):
        """``rows``: the GGUF tensor's raw blocks, uint8 [N, K/block · block bytes] (a tensor or a
        numpy array, e.g. a view of the file's mapping), row n = output n. ``parts`` instead: a weight
        stacked from several tensors along the output rows (q/k/v), each (rows, order or None) of
        ``ggml_type`` or (rows, order, its own type), with ``order`` [n] the source row of each output
        row. Parts of different types become one engine weight of several parts (the rows prepared
        once per product, each part multiplied by its own kind's kernel)."""
        parts = [(rows, None)] if parts is None else parts
        typed = [(part[0], part[1], part[2] if len(part) > 2 else ggml_type) for part in parts]
        groups: list[list] = []  # runs of consecutive parts of one type: one engine weight each
        for part in typed:
            if groups and groups[-1][0][2] == part[2]:
                groups[-1].append(part)
            else:
                groups.append([part])
        if len(groups) > 4:
            raise ValueError(f"a stacked weight holds at most 4 runs of one type, not {len(groups)}")
        packed = [_pack(group[0][2], in_features, numerics, [(r, o) for r, o, _ in group]) for group in groups]
        self.numerics, self.in_features = numerics, in_features
        self.out_features = sum(count for _, count in packed)
        if len(packed) == 1:
            self.ggml_type, self.handle = groups[0][0][2], packed[0][0]
        else:
            self.ggml_type = tuple(group[0][2] for group in groups)
            self.handle = engine().stack_weights(tuple(handle for handle, _ in packed))

    @property
    def type_name(self) -> str:
        """The type's name ("Q4_K"), or its parts' ("Q4_K+Q6_K")."""
        types = self.ggml_type if isinstance(self.ggml_type, tuple) else (self.ggml_type,)
        return "+".join(NATIVE_TYPES[t] for t in types)

    @classmethod
    def quantize(cls, weight: torch.Tensor, numerics: Numerics, ggml_type: int = Q8_0) -> "QuantWeight":
        """A float weight [N, K] (K a multiple of 32) quantised by gguf-py into ``ggml_type`` blocks
        (the draft head's layer on the engine: Q8_0, ~0.4% per weight)."""
        import numpy as np
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        values = np.ascontiguousarray(weight.detach().float().cpu().numpy())
        raw = torch.from_numpy(np.array(quantize(values, GGMLQuantizationType(ggml_type)), copy=True))
        return cls(raw, ggml_type, int(weight.shape[1]), numerics)

    def select(self, indices: torch.Tensor) -> "QuantWeight":
        """Rows ``indices`` [c] as a weight of their own (the same blocks, repacked): a draft
        vocabulary's rows of an LM head, computed as cheaply as the head itself."""
        indices = indices.reshape(-1).to(torch.int64).contiguous()
        if indices.numel() == 0 or int(indices.min()) < 0 or int(indices.max()) >= self.out_features:
            raise IndexError(f"row indices must lie in 0..{self.out_features - 1}")
        if isinstance(self.ggml_type, tuple):
            raise ValueError(f"rows are selected from a weight of one type, not a stacked {self.type_name} one")
        chosen = object.__new__(QuantWeight)
        chosen.ggml_type, chosen.numerics = self.ggml_type, self.numerics
        chosen.out_features, chosen.in_features = int(indices.numel()), self.in_features
        chosen.handle = engine().gather_rows(weight=self.handle, indices=indices.data_ptr(), count=chosen.out_features)
        return chosen

    def __deepcopy__(self, memo) -> "QuantWeight":
        return self  # immutable once packed: copies of a model (layerskip.masks.masked_copy) share it

    @property
    def nbytes(self) -> int:
        """Bytes a pass streams for this weight."""
        return int(engine().weight_bytes(self.handle))

    @property
    def one_thread_rows(self) -> int | None:
        """Products over this many rows or fewer run on one thread, as measured for the model on
        this machine (``costs.few_row_threads``); None: not set, the engine's default for the ISA."""
        return getattr(self, "_one_thread_rows", None)

    @one_thread_rows.setter
    def one_thread_rows(self, rows: int | None) -> None:
        engine().one_thread_rows(weight=self.handle, rows=rows)  # a ValueError outside 0 .. 64 changes nothing
        self._one_thread_rows = rows

    def _rows_of(self, x: torch.Tensor) -> int:
        """The row count of ``x``, refused unless float32 contiguous [M, K]."""
        rows = int(x.shape[0])
        if x.dtype != torch.float32 or not x.is_contiguous() or tuple(x.shape) != (rows, self.in_features):
            raise ValueError(f"the engine multiplies float32 contiguous rows [M, {self.in_features}], not "
                             f"{x.dtype} {tuple(x.shape)}")
        return rows

    def multiply(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [M, K] float32 contiguous → x·Wᵀ [M, N] float32 (into ``out``, or added to it)."""
        rows = self._rows_of(x)
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if out.dtype != torch.float32 or out.shape[0] != rows or out.shape[1] != self.out_features or out.stride(1) != 1:
            raise ValueError(f"the product's output is float32 [{rows}, {self.out_features}] with contiguous rows")
        if rows:
            engine().matmul(weight=self.handle, x=x.data_ptr(), rows=rows, out=out.data_ptr(), out_stride=int(out.stride(0)),
                            accumulate=accumulate, threads=engine_threads())
        return out

    def multiply_with_maxima(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``multiply(x)`` and the index of each row's first maximum among its N outputs (−1 for a row
        holding a NaN): ``sampling.first_maxima`` of the product, found by each engine thread over the
        columns it has just computed (the engine's ``linear_maxima``). The LM head's product this way
        gives a greedy walk its tokens without reading the logits again after the pass (from memory the
        pass's weight stream has moved out of the caches, through a call of its own)."""
        rows = self._rows_of(x)
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        maxima = engine().matmul(weight=self.handle, x=x.data_ptr(), rows=rows, out=out.data_ptr(),
                                 out_stride=self.out_features, accumulate=False, threads=engine_threads(), maxima=True)
        return out, maxima

    def multiply_with_draws(self, x: torch.Tensor, keys: list[int | None],
                            temperatures: list[float]) -> tuple[torch.Tensor, list[int], list[int]]:
        """``multiply_with_maxima(x)`` and each row's keyed draw (``cached_model.RowDraws``): for a row with a
        key, argmax_v(out[v] / temperature + g(v)) under that key's Gumbel noise, the first of equal maxima
        (``sampling.keyed_tokens`` of the row divided by its temperature, bit for bit), drawn by each engine
        thread over the columns it has just computed (the engine's ``linear_draws``); −1 for a row holding a
        NaN, ``sampling.NOT_DRAWN`` (−2) for a row without a key, or one holding +inf or only −inf (left
        to ``sampling.keyed_tokens``)."""
        rows = self._rows_of(x)
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        maxima, draws = engine().matmul(weight=self.handle, x=x.data_ptr(), rows=rows, out=out.data_ptr(),
                                        out_stride=self.out_features, accumulate=False, threads=engine_threads(),
                                        maxima=True, keys=keys, temperatures=temperatures)
        return out, maxima, draws

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` [c] of W as float32 [c, K]: d·q + m exactly as the file defines them. An
        index outside 0 .. N − 1 is an IndexError before any row is read (the engine checks every
        index: no check here, whose reductions ran cold after each pass)."""
        if indices.dtype != torch.int64 or indices.dim() != 1 or indices.device.type != "cpu" \
                or not indices.is_contiguous():
            indices = indices.reshape(-1).to("cpu", torch.int64).contiguous()
        count = int(indices.shape[0])
        out = torch.empty(count, self.in_features, dtype=torch.float32)
        engine().dequant_rows(weight=self.handle, indices=indices.data_ptr(), count=count, out=out.data_ptr())
        return out

    def dense(self) -> torch.Tensor:
        """All of W as float32 [N, K]."""
        return self.rows(torch.arange(self.out_features))


def _pack(ggml_type: int, in_features: int, numerics: Numerics, parts: list) -> tuple[object, int]:
    """(the engine weight, its rows) of ``parts`` [(rows, order or None)], all of ``ggml_type``,
    stacked along the output rows and repacked."""
    if ggml_type not in NATIVE_TYPES:
        raise ValueError(f"ggml type {ggml_type} is not computed natively (native: {sorted(NATIVE_TYPES.values())})")
    inputs, block_bytes = _BLOCKS[ggml_type]
    if in_features % inputs:
        raise ValueError(f"{NATIVE_TYPES[ggml_type]} rows hold whole blocks of {inputs}, not {in_features} values")
    expected = in_features // inputs * block_bytes
    sources = []
    for part, order in parts:
        kept, shape, address = _rows_and_address(part)
        if len(getattr(part, "shape", ())) != 2 or shape[1] != expected:
            raise ValueError(f"{NATIVE_TYPES[ggml_type]} rows of {in_features} values take {expected} bytes each; "
                             f"got rows of shape {tuple(getattr(part, 'shape', ()))}")
        if order is not None and order.numel() and (int(order.min()) < 0 or int(order.max()) >= shape[0]):
            raise ValueError("a row order names rows the part does not have")
        count = shape[0] if order is None else int(order.numel())
        sources.append((kept, address, None if order is None else order.to(torch.int64).contiguous(), count))
    total = sum(count for *_, count in sources)
    handle = engine().new_weight(ggml_type=ggml_type, layout=numerics.layout, round_rows=numerics.round_rows,
                                 out_features=total, in_features=in_features)
    row0 = 0
    for _kept, address, order, count in sources:
        engine().repack(weight=handle, blocks=address, rows=count, order=None if order is None else order.data_ptr(),
                        row0=row0)
        row0 += count
    return handle, total


def _rows_and_address(rows) -> tuple[object, tuple[int, int], int]:
    """(the rows kept alive, their shape as [N, bytes], their address) for a uint8 tensor or numpy
    array, e.g. a read-only view of a mapped file (read in place, not copied)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype != torch.uint8:
            raise ValueError(f"GGUF blocks come as uint8 bytes, not {rows.dtype}")
        rows = rows.contiguous()
        return rows, (int(rows.shape[0]), int(rows[0].numel()) if rows.shape[0] else 0), rows.data_ptr()
    import numpy as np

    array = np.ascontiguousarray(rows)
    if array.dtype != np.uint8:
        raise ValueError(f"GGUF blocks come as uint8 bytes, not {array.dtype}")
    array = array.reshape(array.shape[0], -1)
    return array, (int(array.shape[0]), int(array.shape[1])), int(array.__array_interface__["data"][0])


class QuantLinear(torch.nn.Module):
    """y = x·Wᵀ with W a ``QuantWeight`` (no bias: GGUF Llama projections have none). Inputs of any
    float dtype are read as float32 (the numerics round them as they say); outputs are float32."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.qweight = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():
            flat = flat.to(torch.float32).contiguous()
        return self.qweight.multiply(flat).view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        """W de-quantised (float32 [N, K], a new tensor: for the rare readers, e.g. a slim vocabulary)."""
        return self.qweight.dense()

    @property
    def output_dtype(self) -> torch.dtype:
        return torch.float32

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if prefix + "weight" in state_dict:
            error_msgs.append(f"{prefix}weight: a GGUF-quantised layer cannot load float weights")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{self.qweight.type_name}, {self.qweight.numerics.description}")


class QuantEmbedding(torch.nn.Module):
    """An embedding lookup that de-quantises the rows it is asked for from a ``QuantWeight``
    (shared with a tied LM head: the table is held once, in the file's bytes)."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.rows(ids)
        return rows if ids.dim() == 1 else rows.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table de-quantised (float32 [V, H]; a new tensor)."""
        return self.qweight.dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qweight.type_name}"


def embedded_rows(embedding: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The rows [n, H] float32 contiguous that ``embedding`` gives ids [n]: a ``QuantEmbedding``
    without hooks read directly (one engine call: a module call and conversions are torch operators
    that run cold right after a pass has streamed the weights), any other table (a scaled one, a
    hooked one, whose hooks then run) through its module."""
    if type(embedding) is QuantEmbedding and not embedding._forward_hooks and not embedding._forward_pre_hooks:
        return embedding.qweight.rows(ids)
    with torch.no_grad():
        return embedding(ids.cpu()).float().contiguous()


# ---- reading a GGUF file ---------------------------------------------------------------------------


@dataclass
class GgufTensor:
    """One tensor of a GGUF file: its ggml type, shape as [rows, row length] (ggml's ne[1], ne[0];
    1-D tensors have rows = 1) and raw data (uint8 rows of blocks for quantised types)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: "object"  # numpy array (a view of the file's mapping)

    @property
    def native(self) -> bool:
        return self.ggml_type in NATIVE_TYPES

    def raw_rows(self) -> torch.Tensor:
        """The blocks as uint8 [N, bytes per row] (a copy, not a view of the mapping)."""
        import numpy as np

        return torch.from_numpy(np.array(self.data, copy=True)).view(torch.uint8).reshape(self.shape[0], -1)

    def block_rows(self):
        """The blocks as a read-only numpy uint8 [N, bytes per row] view of the file's mapping."""
        return self.data.reshape(self.shape[0], -1)

    def dequantized(self) -> torch.Tensor:
        """The values as float32 (any type gguf-py can de-quantise), shape [N, K] or [K]."""
        import numpy as np

        if self.ggml_type == 0:  # F32 (norms): copied as they are
            return torch.from_numpy(np.array(self.data, dtype=np.float32, copy=True)).reshape(self.shape)
        from gguf import GGMLQuantizationType, dequantize

        raw = np.asarray(self.data)
        if self.ggml_type != 0:
            raw = raw.reshape(self.shape[0], -1) if len(self.shape) == 2 else raw
        values = dequantize(raw, GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True)).reshape(self.shape)


def read_gguf_tensors(path: Path, header=None) -> tuple[dict[str, GgufTensor], dict[str, object]]:
    """The tensors of a GGUF file by name (their data views of a read-only mapping of the file, which
    lives as long as they do) and its scalar and string header fields. ``header``: the file's
    ``gguf_check.GgufHeader`` where the caller checked it already; else it is checked here. Every
    view lies inside the file and inside its own tensor's bytes (``gguf_check`` refused any file
    where one would not), so no repacking reads past a tensor. Raises ``gguf_check.GgufFileError``."""
    import numpy as np

    from .gguf_check import check_gguf

    path = Path(path)
    if header is None:
        header = check_gguf(path)
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {error}") from None
    if len(mapped) != header.file_size:
        raise ModelLoadError(f"{path} changed while it was read ({header.file_size} bytes, now {len(mapped)})")
    tensors = {}
    for name, info in header.tensors.items():
        data = mapped[info.offset : info.offset + info.nbytes]
        if info.ggml_type == 0:  # F32
            data = data.view(np.float32)
        tensors[name] = GgufTensor(name, info.ggml_type, info.shape, data)
    return tensors, header.scalars()


def unpermute_order(count: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores q/k projection rows interleaved for its rotary layout; the
    source row of each row in transformers' order (rows are whole: a permutation keeps every block)."""
    half = count // heads // 2
    return torch.arange(count).view(heads, half, 2).transpose(1, 2).reshape(-1)


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """``rows`` [count, ...] in transformers' order (``unpermute_order``)."""
    return rows.index_select(0, unpermute_order(int(rows.shape[0]), heads))
