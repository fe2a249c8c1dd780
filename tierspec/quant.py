"""Linear layers and an embedding that compute with a GGUF file's own quantised blocks.

A GGUF file stores most of a model's weights in blocks of 32: Q4_1 as 4-bit values q with the
block's fp16 scale d and minimum m (w = d·q + m), Q4_0 as w = d·(q − 8), Q8_0 as 8-bit values with
a scale (w = d·q). De-quantising them into bfloat16 copies (what tierspec did before) streams 3.4×
the file's bytes per pass and rounds the weights again (d·q + m does not fit bfloat16's 8-bit
significand). Here the blocks are kept, repacked once at load into the layout of tierspec's pass
engine (``tierspec/csrc/qengine.c``: tiles of 16 output rows, the same values), and every product
de-quantises a weight tile once for all the rows of its pass, so a pass over 1–16 new tokens costs
about what one costs.

How the products round (``Numerics``): with native bfloat16 products (AVX512-BF16) the rows are
rounded to bfloat16 and each block's Σ q·x is summed in float32 before its scale is applied — the
weights themselves exact; elsewhere, or with ``dtype=float32``, the rows stay float32 and the
products are float32 FMAs with the exact weights (bfloat16 asked for on such a CPU rounds the rows
first: emulated). Outputs are float32 either way, and a row's result never depends on the other
rows of its pass (every output is summed in an order fixed by the weight's shape).

Native: Q4_0, Q4_1, Q8_0. Other types (K-quants, F16, …) are de-quantised to float as before.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from .engine import engine, engine_threads
from .errors import ModelLoadError

# ggml type ids (ggml.h) of the natively computed block types
Q4_0, Q4_1, Q8_0 = 2, 3, 8
NATIVE_TYPES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0"}
_KIND = {Q4_0: 0, Q4_1: 0, Q8_0: 1}  # the engine's kinds: 4-bit (with a minimum) and 8-bit
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
BLOCK = 32
LAYOUT_BFLOAT16_DOT, LAYOUT_FLOAT32_FMA, LAYOUT_INT8_DOT = 0, 1, 2


@dataclass(frozen=True)
class Numerics:
    """How a quantised layer's products round: ``layout`` (the engine's kernels: bfloat16 dot
    products, or float32 FMAs) and ``round_rows`` (float32 FMAs on rows rounded to bfloat16
    values: bfloat16 emulated). ``dtype`` is what the user asked for."""

    dtype: torch.dtype
    layout: int
    round_rows: bool

    @property
    def description(self) -> str:
        if self.layout == LAYOUT_INT8_DOT:
            return "8-bit rows per block of 32, int32 sums (AVX512-VNNI)"
        if self.layout == LAYOUT_BFLOAT16_DOT:
            return "bfloat16 rows, float32 sums (AVX512-BF16)"
        return "bfloat16 rows emulated on float32 FMAs" if self.round_rows else "float32 rows, float32 FMAs"


def numerics_for(dtype: torch.dtype) -> Numerics:
    """bfloat16: native dot products where the CPU has them (AVX512-BF16), else emulated;
    float32: float32 FMAs; int8: each block of 32 row values rounded to 8 bits with its own scale,
    as llama.cpp rounds activations (int32 dot products on AVX512-VNNI, the same integers and the same
    float steps in portable loops elsewhere). Other dtypes are refused (the outputs are float32)."""
    if dtype == torch.bfloat16:
        native = engine().isa() == "avx512bf16"
        return Numerics(dtype, LAYOUT_BFLOAT16_DOT if native else LAYOUT_FLOAT32_FMA, not native)
    if dtype == torch.float32:
        return Numerics(dtype, LAYOUT_FLOAT32_FMA, False)
    if dtype == torch.int8:
        return Numerics(dtype, LAYOUT_INT8_DOT, False)
    raise ModelLoadError(f"GGUF kernels compute with bfloat16, float32 or int8 rows, not {dtype}; use --dtype auto, "
                         "bfloat16, float32 or int8")


class QuantWeight:
    """A [N, K] weight of one native GGUF type, repacked for the engine (``packed``: uint8)."""

    def __init__(self, rows, ggml_type: int, in_features: int, numerics: Numerics, parts: list | None = None):
        """``rows``: the GGUF tensor's raw blocks, uint8 [N, K/32 · block bytes] (a tensor or a numpy
        array, e.g. a view of the file's mapping), row n = output n. ``parts`` instead: a weight
        stacked from several tensors of one type along the output rows (q/k/v), each
        (rows, order or None) with ``order`` [n] the source row of each output row."""
        if ggml_type not in NATIVE_TYPES:
            raise ValueError(f"ggml type {ggml_type} is not computed natively (native: {sorted(NATIVE_TYPES.values())})")
        if in_features % BLOCK:
            raise ValueError(f"{NATIVE_TYPES[ggml_type]} rows hold whole blocks of {BLOCK}, not {in_features} values")
        expected = in_features // BLOCK * _BLOCK_BYTES[ggml_type]
        parts = parts if parts is not None else [(rows, None)]
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
        qe = engine()
        self.ggml_type, self.kind = ggml_type, _KIND[ggml_type]
        self.out_features, self.in_features = sum(count for *_, count in sources), in_features
        self.numerics = numerics
        self.packed = torch.empty(qe.packed_bytes(ggml_type, self.out_features, in_features), dtype=torch.uint8)
        row0 = 0
        for _kept, address, order, count in sources:
            qe.repack(ggml_type, numerics.layout, address, None if order is None else order.data_ptr(), count,
                      in_features, self.packed.data_ptr(), row0)
            row0 += count

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
        qe = engine()
        chosen = object.__new__(QuantWeight)
        chosen.ggml_type, chosen.kind, chosen.numerics = self.ggml_type, self.kind, self.numerics
        chosen.out_features, chosen.in_features = int(indices.numel()), self.in_features
        chosen.packed = torch.empty(qe.packed_bytes(self.ggml_type, chosen.out_features, self.in_features),
                                    dtype=torch.uint8)
        qe.gather_rows(self.kind, self.numerics.layout, self.packed.data_ptr(), self.in_features, indices.data_ptr(),
                       chosen.out_features, chosen.packed.data_ptr())
        return chosen

    def __deepcopy__(self, memo) -> "QuantWeight":
        return self  # immutable once packed: copies of a model (layerskip.masks.masked_copy) share it

    @property
    def nbytes(self) -> int:
        """Bytes a pass streams for this weight."""
        return int(self.packed.numel())

    def multiply(self, x: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
        """x [M, K] float32 contiguous → x·Wᵀ [M, N] float32 (into ``out``, or added to it)."""
        rows = int(x.shape[0])
        if out is None:
            out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:
            engine().matmul(self.kind, self.numerics.layout, self.packed.data_ptr(), self.out_features,
                            self.in_features, int(self.numerics.round_rows), x.data_ptr(), rows, out.data_ptr(),
                            int(out.stride(0)), int(accumulate), engine_threads())
        return out

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` [c] of W as float32 [c, K]: d·q + m exactly as the file defines them."""
        indices = indices.reshape(-1).to(torch.int64).contiguous()
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.out_features):
            raise IndexError(f"row index out of range 0..{self.out_features - 1}")
        out = torch.empty(int(indices.numel()), self.in_features, dtype=torch.float32)
        engine().dequant_rows(self.kind, self.numerics.layout, self.packed.data_ptr(), self.out_features,
                              self.in_features, indices.data_ptr(), int(indices.numel()), out.data_ptr())
        return out

    def dense(self) -> torch.Tensor:
        """All of W as float32 [N, K]."""
        return self.rows(torch.arange(self.out_features))


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
                f"{NATIVE_TYPES[self.qweight.ggml_type]}, {self.qweight.numerics.description}")


class QuantEmbedding(torch.nn.Module):
    """An embedding lookup that de-quantises the rows it is asked for from a ``QuantWeight``
    (shared with a tied LM head: the table is held once, in the file's bytes)."""

    def __init__(self, weight: QuantWeight):
        super().__init__()
        self.qweight = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.rows(ids.cpu()).view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table de-quantised (float32 [V, H]; a new tensor)."""
        return self.qweight.dense()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {NATIVE_TYPES[self.qweight.ggml_type]}"


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


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Cursor:
    """Reads little-endian GGUF header values from a mapped file (gguf-py's reader parses every
    field into Python objects, 2 s for the default model's tokenizer lists: too slow to start)."""

    def __init__(self, buffer, path: Path):
        self.buffer, self.offset, self.path = buffer, 0, path

    def take(self, fmt: str):
        import struct

        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise ModelLoadError(f"the GGUF file {self.path} is cut short in its header (truncated?)")
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.offset + length > len(self.buffer):
            raise ModelLoadError(f"the GGUF file {self.path} is cut short in its header (truncated?)")
        text = bytes(self.buffer[self.offset : self.offset + length]).decode("utf-8", "replace")
        self.offset += length
        return text

    def value(self, kind: int, keep: bool):
        """A field value (None where not ``keep``: arrays and strings skipped without decoding)."""
        import struct

        if kind in _GGUF_SCALARS:
            return self.take(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            if keep:
                return self.string()
            length = self.take("<Q")
            self.offset += length
            return None
        if kind == _GGUF_ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item in _GGUF_SCALARS:
                self.offset += count * struct.calcsize(_GGUF_SCALARS[item])
            elif item == _GGUF_STRING:  # a tokenizer's 49k strings: each a length and its bytes, skipped
                buffer, offset, end = self.buffer, self.offset, len(self.buffer)
                for _ in range(count):
                    if offset + 8 > end:
                        raise ModelLoadError(f"the GGUF file {self.path} is cut short in its header (truncated?)")
                    offset += 8 + int.from_bytes(buffer[offset : offset + 8], "little")
                self.offset = offset
            else:
                for _ in range(count):
                    self.value(item, False)
            return None
        raise ModelLoadError(f"the GGUF file {self.path} has a header value of unknown type {kind} (damaged?)")


# ggml's types: (values per block, bytes per block), from the format (ggml.h / gguf-py's
# GGML_QUANT_SIZES): sizing a tensor needs no import of gguf-py (~90 ms at start-up).
GGML_BLOCKS = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
               10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
               16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110), 22: (256, 82),
               23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2),
               34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}


def read_gguf_tensors(path: Path) -> tuple[dict[str, GgufTensor], dict[str, object]]:
    """The tensors of a GGUF file by name (their data views of a read-only mapping of the file, which
    lives as long as they do) and its scalar and string header fields. Raises ModelLoadError for a
    file that is not GGUF, is cut short, or whose tensors do not fit it."""
    import numpy as np

    path = Path(path)
    try:
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot read the GGUF file {path}: {error}") from None
    cursor = _Cursor(memoryview(mapped), path)
    if len(mapped) < 24 or bytes(mapped[:4]) != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.offset = 4
    version, tensor_count, field_count = cursor.take("<I"), cursor.take("<Q"), cursor.take("<Q")
    if version < 2:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or later)")
    fields: dict[str, object] = {}
    for _ in range(field_count):
        name, kind = cursor.string(), cursor.take("<I")
        value = cursor.value(kind, keep=True)
        if value is not None:
            fields[name] = value
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        infos.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    alignment = int(fields.get("general.alignment", 32))
    base = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, kind, offset in infos:
        if kind not in GGML_BLOCKS:
            raise ModelLoadError(f"{path}: tensor {name!r} has an unknown ggml type {kind}")
        block, block_bytes = GGML_BLOCKS[kind]
        count = int(np.prod(dims)) if dims else 1
        if dims[0] % block:
            raise ModelLoadError(f"{path}: tensor {name!r} rows of {dims[0]} values are not whole blocks of {block}")
        nbytes = count // block * block_bytes
        start = base + offset
        if start + nbytes > len(mapped):
            raise ModelLoadError(f"{path}: tensor {name!r} reaches past the end of the file (truncated?)")
        rows = count // dims[0]
        shape = (rows, dims[0]) if len(dims) >= 2 else (dims[0],)
        data = mapped[start : start + nbytes]
        if kind == 0:  # F32
            data = data.view(np.float32)
        tensors[name] = GgufTensor(name, kind, shape, data)
    return tensors, fields


def unpermute_order(count: int, heads: int) -> torch.Tensor:
    """llama.cpp's converter stores q/k projection rows interleaved for its rotary layout; the
    source row of each row in transformers' order (rows are whole: a permutation keeps every block)."""
    half = count // heads // 2
    return torch.arange(count).view(heads, half, 2).transpose(1, 2).reshape(-1)


def unpermute_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """``rows`` [count, ...] in transformers' order (``unpermute_order``)."""
    return rows.index_select(0, unpermute_order(int(rows.shape[0]), heads))
