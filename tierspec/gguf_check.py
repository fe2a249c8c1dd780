"""A GGUF file checked from its header alone before anything reads its tensors.

A damaged GGUF file used to reach transformers' converter or the pass engine's repacking and come
out as blank text with exit 0 (``block_count`` 0; a tensor's offset moved onto another's bytes; a
tensor's type changed, so that its blocks are read from its neighbour's), as a conversion that
never ends (``block_count`` 1000), or as another library's words ("list index out of range",
"integer modulo by zero", a utf-8 codec error). ``check_gguf`` reads the header (no tensor data
but the few bytes of 1-D float tensors, the norms) and refuses such a file in one line that names
the file, the key or tensor, what it holds and what was expected (``GgufFileError``).

What is checked, in the order a reader meets it:

- the header's structure: magic, version (2 or 3), and every count and length bounded by the bytes
  left in the file *before* anything is allocated for it (a string of 2⁶³ bytes, an array of 2⁶⁰
  items, 2⁵⁰ tensors are refused at once, not attempted); every key, string and tensor name valid
  UTF-8; value types known; arrays nested at most ``MAX_ARRAY_DEPTH`` deep;
- each tensor: a name of at most 63 bytes (ggml's limit), 1–4 dimensions each ≥ 1, a known ggml
  type (``gguf.GGML_QUANT_SIZES``: F32, F16, BF16, the Q*_0/1 and K-quants and the rest), rows of
  whole blocks, an element count without overflow, a name used once;
- the data: ``general.alignment`` a power of two; each tensor's offset aligned, its byte size (what
  its type and shape imply) inside the file, and the tensors laid end to end as GGUF writers lay
  them — no overlap, no unexplained gap (a tensor's type or shape changed shows as one), nothing
  after the last; 1-D float tensors (norms, biases) finite;
- for ``llama`` (Mistral files are ``llama`` too), ``qwen2``, ``qwen3``, ``gemma3`` and ``phi3``: the
  metadata a model is built from (block count, embedding and feed-forward lengths, heads, KV heads,
  head dims, vocabulary) present, in range and consistent, the token list as long as the vocabulary,
  special token ids inside it, and exactly the tensors of that architecture (``gguf.MODEL_TENSORS``)
  for that many blocks, each of the shape the metadata implies. Other architectures get the checks
  above and go on to transformers.

The result, ``GgufHeader``, holds the metadata and tensor infos, so a loader need not read the
header again (``quant.read_gguf_tensors`` maps the tensors it describes).
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME (64) with its terminating zero
MAX_ARRAY_DEPTH = 3
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType): struct formats of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
# The fewest bytes an item of each value type takes (a string: its 8-byte length; an array: type + count).
_MIN_ITEM_BYTES = {**{kind: struct.calcsize(fmt) for kind, fmt in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_FIELD_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset

_FLOAT_TYPES = {0: "<f4", 1: "<f2", 30: "bfloat16"}  # F32, F16, BF16: 1-D ones are read to check they are finite
_FINITE_CHECK_BYTES = 1 << 20  # per tensor: norms and biases are a few kB; larger 1-D tensors are not read


class GgufFileError(ModelLoadError):
    """A GGUF file that is damaged or does not fit its own metadata. ``str()`` is one line: the
    file, the key or tensor, what was found and what was expected."""

    def __init__(self, path: Path, subject: str, found: str, expected: str):
        self.path, self.subject, self.found, self.expected = Path(path), subject, found, expected
        super().__init__(_one_line(f"{path}: {subject}: {found}; expected {expected}"))


def _one_line(text: str) -> str:
    return " ".join(text.split())


@dataclass(frozen=True)
class GgufArray:
    """A header array, described rather than decoded (a tokenizer's 49k strings are read on demand
    by ``GgufHeader.array``): item type, item count and where its items start in the file."""

    item_type: int
    count: int
    start: int
    nbytes: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor as the header describes it: ggml type, dims in ggml's order (ne0 = the row
    length first), absolute byte offset of its data in the file and byte size."""

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.ggml_type)

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def shape(self) -> tuple[int, ...]:
        """As ``quant.GgufTensor`` holds it: [rows, row length] (all dims past the first folded into
        the rows), or [length] for a 1-D tensor."""
        return (self.elements // self.dims[0], self.dims[0]) if len(self.dims) >= 2 else (self.dims[0],)


@dataclass(frozen=True)
class GgufHeader:
    """A checked GGUF header: its metadata (scalars and strings as Python values, arrays as
    ``GgufArray``) and its tensors by name, in the header's order."""

    path: Path
    version: int
    file_size: int
    alignment: int
    data_offset: int  # where the tensor data section starts
    fields: dict[str, object]
    tensors: dict[str, GgufTensorInfo]
    field_types: dict[str, int] = field(repr=False, default_factory=dict)

    @property
    def architecture(self) -> str | None:
        value = self.fields.get("general.architecture")
        return value if isinstance(value, str) else None

    def scalars(self) -> dict[str, object]:
        """The metadata without its arrays (what ``quant.read_gguf_tensors`` callers read)."""
        return {key: value for key, value in self.fields.items() if not isinstance(value, GgufArray)}

    def array(self, key: str) -> list:
        """The items of the array ``key`` (strings decoded): read from the file now, bounded as
        they were when the header was checked."""
        value = self.fields[key]
        if not isinstance(value, GgufArray):
            raise TypeError(f"{key} is not an array")
        with _mapped(self.path) as buffer:
            reader = _Reader(buffer, self.path)
            reader.offset = value.start
            return [reader.value(value.item_type, f"{key}[{i}]", depth=1, keep=True) for i in range(value.count)]


def ggml_type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def ggml_type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id → (values per block, bytes per block), from gguf-py (the format's own table)."""
    from gguf import GGML_QUANT_SIZES

    return {int(kind): sizes for kind, sizes in GGML_QUANT_SIZES.items()}


class _mapped:
    """A read-only mapping of a file (an empty file maps as empty bytes)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.handle = open(self.path, "rb")
        size = self.handle.seek(0, 2)
        self.map = mmap.mmap(self.handle.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        return self.map if self.map is not None else b""

    def __exit__(self, *exc):
        if self.map is not None:
            self.map.close()
        self.handle.close()


class _Reader:
    """Bounded little-endian reads from the mapped header: every read is checked against the end
    of the file first, and every count or length against the bytes left before it is used."""

    def __init__(self, buffer, path: Path):
        self.buffer, self.path, self.offset, self.size = buffer, path, 0, len(buffer)

    def fail(self, subject: str, found: str, expected: str):
        raise GgufFileError(self.path, subject, found, expected)

    def left(self) -> int:
        return self.size - self.offset

    def take(self, fmt: str, subject: str):
        size = struct.calcsize(fmt)
        if size > self.left():
            self.fail(subject, f"the file ends at byte {self.size}",
                      f"{size} bytes at byte {self.offset} (the file is cut short)")
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += size
        return value

    def count(self, fmt: str, subject: str, item_bytes: int, what: str) -> int:
        """A count of items of at least ``item_bytes`` bytes each, refused where the rest of the
        file cannot hold that many."""
        value = self.take(fmt, subject)
        room = self.left() // item_bytes
        if value > room:
            self.fail(subject, f"{what} {value}", f"at most {room} (what the {self.left()} bytes left in the file hold)")
        return value

    def text(self, subject: str, limit: int | None = None, keep: bool = True) -> str | None:
        length = self.count("<Q", subject, 1, "a string length of")
        if limit is not None and length > limit:
            self.fail(subject, f"a name of {length} bytes", f"at most {limit}")
        start = self.offset
        self.offset += length
        try:
            value = str(self.buffer[start:self.offset], "utf-8")
        except UnicodeDecodeError as error:
            self.fail(subject, f"bytes that are not UTF-8 text (byte {error.start} of {length}, at file offset {start})",
                      "UTF-8 text")
        return value if keep else None

    def skip_strings(self, count: int, subject: str) -> None:
        """``count`` strings (a tokenizer's 49k tokens, its merges) checked as ``text`` checks one,
        without keeping them: the loop ``text`` would run, with its lookups hoisted (3× faster)."""
        buffer, offset, size, unpack = self.buffer, self.offset, self.size, struct.unpack_from
        for i in range(count):
            if offset + 8 > size:
                self.offset = offset
                self.take("<Q", f"{subject}[{i}]")  # fails: names the item
            length = unpack("<Q", buffer, offset)[0]
            end = offset + 8 + length
            if end > size:
                self.offset = offset
                self.text(f"{subject}[{i}]")  # fails: names the item and its length
            try:
                buffer[offset + 8:end].decode()
            except UnicodeDecodeError:
                self.offset = offset
                self.text(f"{subject}[{i}]")  # fails: names the byte
            offset = end
        self.offset = offset

    def value(self, kind: int, subject: str, depth: int = 0, keep: bool = True):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind], subject)
        if kind == _STRING:
            return self.text(subject, keep=keep)
        if kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                self.fail(subject, f"arrays nested {depth + 1} deep", f"at most {MAX_ARRAY_DEPTH}")
            item = self.take("<I", subject)
            if item not in _MIN_ITEM_BYTES:
                self.fail(subject, f"an array of value type {item}", "one of the GGUF value types 0–12")
            count = self.count("<Q", subject, _MIN_ITEM_BYTES[item], "an array count of")
            start = self.offset
            if item in _SCALARS:
                self.offset += count * _MIN_ITEM_BYTES[item]
            elif item == _STRING:
                self.skip_strings(count, subject)
            else:
                for i in range(count):
                    self.value(item, f"{subject}[{i}]", depth + 1, keep=False)
            return GgufArray(item, count, start, self.offset - start)
        self.fail(subject, f"value type {kind}", "one of the GGUF value types 0–12")


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file ``path`` with its structure and data layout checked (see the
    module doc; no architecture checks). Raises ``GgufFileError``."""
    path = Path(path)
    try:
        with _mapped(path) as buffer:
            return _read_header(buffer, path)
    except OSError as error:
        raise GgufFileError(path, "the file", f"cannot be read ({error.strerror or error})", "a readable file") from None


def _read_header(buffer, path: Path) -> GgufHeader:
    reader = _Reader(buffer, path)
    if reader.size < 4 or bytes(buffer[:4]) != GGUF_MAGIC:
        found = bytes(buffer[:4])
        reader.fail("the magic", f"{found!r}" if found else "an empty file", f"{GGUF_MAGIC!r} (not a GGUF file?)")
    reader.offset = 4
    version = reader.take("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        reader.fail("the version", f"{version}", f"one of {', '.join(map(str, SUPPORTED_VERSIONS))}")
    tensor_count = reader.take("<Q", "the tensor count")
    field_count = reader.count("<Q", "the metadata count", _MIN_FIELD_BYTES, "a count of")
    if tensor_count * _MIN_TENSOR_INFO_BYTES > reader.left():
        reader.fail("the tensor count", f"{tensor_count}",
                    f"at most {reader.left() // _MIN_TENSOR_INFO_BYTES} (what the rest of the file holds)")
    fields: dict[str, object] = {}
    types: dict[str, int] = {}
    for index in range(field_count):
        key = reader.text(f"metadata key #{index}", limit=65535)
        kind = reader.take("<I", f"metadata {key!r}")
        value = reader.value(kind, f"metadata {key!r}")
        if key in fields:
            reader.fail(f"metadata {key!r}", "a key written twice", "each key once")
        fields[key], types[key] = value, kind
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if types.get("general.alignment", 4) not in _INTEGER_TYPES or not isinstance(alignment, int) \
            or alignment < 1 or alignment & (alignment - 1):
        reader.fail("metadata 'general.alignment'", f"{alignment!r}", "a power of two (32 by default)")
    sizes = ggml_type_sizes()
    infos = []
    names: set[str] = set()
    for index in range(tensor_count):
        name = reader.text(f"tensor #{index}'s name", limit=MAX_NAME_BYTES)
        subject = f"tensor {name!r}"
        if not name:
            reader.fail(f"tensor #{index}'s name", "an empty name", f"a name of 1 to {MAX_NAME_BYTES} bytes")
        if name in names:
            reader.fail(subject, "a name used twice", "each tensor named once")
        names.add(name)
        n_dims = reader.take("<I", subject)
        if not 1 <= n_dims <= MAX_DIMS:
            reader.fail(subject, f"{n_dims} dimensions", f"1 to {MAX_DIMS}")
        dims = tuple(reader.take("<Q", subject) for _ in range(n_dims))
        kind = reader.take("<I", subject)
        relative = reader.take("<Q", subject)
        if min(dims) < 1:
            reader.fail(subject, f"dimensions {list(dims)}", "every dimension at least 1")
        if kind not in sizes:
            reader.fail(subject, f"ggml type id {kind}", "a known ggml type (gguf.GGMLQuantizationType)")
        block, block_bytes = sizes[kind]
        elements = math.prod(dims)
        if elements >= 1 << 63:
            reader.fail(subject, f"dimensions {list(dims)} ({elements} values)", "fewer than 2^63 values")
        if dims[0] % block:
            reader.fail(subject, f"rows of {dims[0]} {ggml_type_name(kind)} values",
                        f"a multiple of its block of {block}")
        if relative % alignment:
            reader.fail(subject, f"data offset {relative}", f"a multiple of the alignment {alignment}")
        infos.append((name, kind, dims, relative, elements // block * block_bytes))
    data_offset = -(-reader.offset // alignment) * alignment
    tensors = {name: GgufTensorInfo(name, kind, dims, data_offset + relative, nbytes)
               for name, kind, dims, relative, nbytes in infos}
    header = GgufHeader(path, version, reader.size, alignment, data_offset, fields, tensors, types)
    _check_layout(header)
    _check_finite(header, buffer)
    return header


def _check_layout(header: GgufHeader) -> None:
    """Every tensor inside the file, and the tensors laid end to end from the data section's start
    (each padded to the alignment), as GGUF writers lay them: an overlap means two tensors read the
    same bytes, a gap or trailing bytes that a tensor's type or shape no longer fits its data."""
    path, size, align = header.path, header.file_size, header.alignment

    def describe(t: GgufTensorInfo) -> str:
        return f"{t.type_name} {list(t.dims)} ({t.nbytes} bytes at offset {t.offset})"

    for tensor in header.tensors.values():
        if tensor.offset + tensor.nbytes > size:
            raise GgufFileError(path, f"tensor {tensor.name!r}", f"{describe(tensor)} reaches past the end of the file "
                                f"at {size}", "its data inside the file (the file is cut short?)")
    expected_start, previous = header.data_offset, None
    order = {name: i for i, name in enumerate(header.tensors)}  # at one offset, the header's first comes first
    for tensor in sorted(header.tensors.values(), key=lambda t: (t.offset, order[t.name])):
        subject = f"tensor {tensor.name!r}"
        if tensor.offset < expected_start:
            assert previous is not None
            raise GgufFileError(path, subject, f"{describe(tensor)} overlaps tensor {previous.name!r}, "
                                f"{describe(previous)}", "each tensor's bytes its own")
        if tensor.offset > expected_start:
            unused = tensor.offset - expected_start
            if previous is None:
                raise GgufFileError(path, subject, f"{describe(tensor)} leaves {unused} unused bytes before it at the "
                                    f"start of the data section (offset {header.data_offset})",
                                    "the first tensor at the data section's start")
            raise GgufFileError(path, f"tensor {previous.name!r}", f"{describe(previous)} is followed by {unused} "
                                f"unused bytes before tensor {tensor.name!r}",
                                "its type and shape to fill its data (changed type or shape?)")
        expected_start = -(-(tensor.offset + tensor.nbytes) // align) * align
        previous = tensor
    if previous is not None and size > expected_start:
        raise GgufFileError(path, f"tensor {previous.name!r}", f"{describe(previous)} is followed by {size - expected_start} "
                            f"bytes at the end of the file", "its type and shape to fill the file's data "
                            "(changed type or shape, or bytes appended?)")


def _check_finite(header: GgufHeader, buffer) -> None:
    """1-D float tensors (norm weights, biases: a few kB each) hold no NaN or infinity: one would
    turn every later activation into NaN, and greedy decoding then emits token 0 silently."""
    import numpy as np

    for tensor in header.tensors.values():
        if len(tensor.dims) != 1 or tensor.ggml_type not in _FLOAT_TYPES or tensor.nbytes > _FINITE_CHECK_BYTES:
            continue
        raw = np.frombuffer(bytes(buffer[tensor.offset:tensor.offset + tensor.nbytes]), dtype=np.uint8)  # a copy: the map closes
        if tensor.ggml_type == 30:  # bfloat16: the high half of a float32
            values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            values = raw.view(_FLOAT_TYPES[tensor.ggml_type])
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            raise GgufFileError(header.path, f"tensor {tensor.name!r}", f"{bad.size} non-finite values "
                                f"(the first, {values[bad[0]]}, at index {int(bad[0])})", "finite values")


# ---- architectures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSizes:
    """The sizes an architecture's tensors are built from, read from the metadata."""

    blocks: int
    embedding: int
    feed_forward: tuple[int, ...]  # per block
    heads: tuple[int, ...]
    kv_heads: tuple[int, ...]
    key_length: int
    value_length: int
    rope_dims: int
    vocabulary: int
    experts: int


# Architectures checked tensor by tensor; the rest get the structural checks only.
CHECKED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")
_INTEGER_TENSOR_TYPES = ("I8", "I16", "I32", "I64")
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def check_gguf(path: Path) -> GgufHeader:
    """``read_header`` and, for the architectures of ``CHECKED_ARCHITECTURES``, the metadata and
    the tensor set and shapes it implies. Raises ``GgufFileError`` (one line); returns the header."""
    header = read_header(path)
    architecture = header.fields.get("general.architecture")
    if not isinstance(architecture, str):
        _fail_key(header, "general.architecture", architecture, "the architecture's name (text)")
    _check_blocks_named(header)
    if architecture in CHECKED_ARCHITECTURES:
        sizes = model_sizes(header, architecture)
        _check_tensor_set(header, architecture, sizes)
    return header


def _fail_key(header: GgufHeader, key: str, value, expected: str):
    found = "missing" if key not in header.fields and value is None else (
        f"an array of {value.count}" if isinstance(value, GgufArray) else repr(value))
    raise GgufFileError(header.path, f"metadata {key!r}", found, expected)


def _check_blocks_named(header: GgufHeader) -> None:
    """A file whose ``{arch}.block_count`` disagrees with the blocks its tensors hold, for any
    architecture that names tensors blk.N (the generic check of the count)."""
    architecture = header.architecture
    key = f"{architecture}.block_count"
    blocks = {int(match.group(1)) for name in header.tensors if (match := _BLOCK.match(name))}
    if key not in header.fields or not blocks:
        return
    count = header.fields[key]
    if header.field_types.get(key) not in _INTEGER_TYPES or isinstance(count, bool):
        _fail_key(header, key, count, "an integer")
    if count != max(blocks) + 1 or len(blocks) != count:
        holds = (f"the tensors of {len(blocks)} blocks (blk.{min(blocks)} to blk.{max(blocks)})" if len(blocks) == max(blocks) + 1
                 else f"tensors of blocks {_ranges(sorted(blocks))}")
        raise GgufFileError(header.path, f"metadata {key!r}", f"{count}, but the file holds {holds}",
                            f"the number of blocks whose tensors the file holds ({max(blocks) + 1}, with every block "
                            "from blk.0)")


def _ranges(values: list[int]) -> str:
    parts, start = [], values[0]
    for previous, value in zip(values, values[1:] + [None]):
        if value != previous + 1:
            parts.append(str(start) if start == previous else f"{start}–{previous}")
            start = value
    return ", ".join(parts)


def _integer(header: GgufHeader, key: str, default: int | None = None, least: int = 1, most: int = 1 << 31) -> int:
    value = header.fields.get(key, default)
    if value is None:
        _fail_key(header, key, None, f"an integer ≥ {least} (the model cannot be built without it)")
    if key in header.fields and (header.field_types.get(key) not in _INTEGER_TYPES or isinstance(value, bool)):
        _fail_key(header, key, value, "an integer")
    if not least <= value <= most:
        _fail_key(header, key, value, f"an integer from {least} to {most}")
    return int(value)


def _positive_float(header: GgufHeader, key: str, low: float, high: float) -> None:
    """A float the forward pass divides or exponentiates by (rope base, norm epsilon), where given:
    finite, in (low, high) — a NaN or 0 there makes every logit NaN and the text blank."""
    if key not in header.fields:
        return
    value = header.fields[key]
    if header.field_types.get(key) not in (6, 12) or not (math.isfinite(value) and low < value < high):
        _fail_key(header, key, value, f"a finite number in ({low:g}, {high:g})")


def _per_block(header: GgufHeader, key: str, blocks: int, default: int | None = None, least: int = 1) -> tuple[int, ...]:
    """A size given once for every block, or as an array of one value per block (llama.cpp
    accepts both)."""
    value = header.fields.get(key)
    if isinstance(value, GgufArray):
        if value.item_type not in _INTEGER_TYPES or value.count != blocks:
            _fail_key(header, key, value, f"an integer, or an array of {blocks} integers (one per block)")
        items = tuple(int(v) for v in header.array(key))
        if min(items) < least:
            _fail_key(header, key, min(items), f"every item ≥ {least}")
        return items
    return (_integer(header, key, default, least),) * blocks


def model_sizes(header: GgufHeader, architecture: str) -> ModelSizes:
    """The sizes of the model in ``header``'s metadata, each checked for presence, type and range
    and against the others."""
    a = architecture
    blocks = _integer(header, f"{a}.block_count", least=1, most=1 << 16)
    embedding = _integer(header, f"{a}.embedding_length")
    experts = _integer(header, f"{a}.expert_count", default=0, least=0, most=1 << 16)
    feed_forward = _per_block(header, f"{a}.feed_forward_length", blocks)
    heads = _per_block(header, f"{a}.attention.head_count", blocks)
    kv_default = heads[0] if f"{a}.attention.head_count_kv" not in header.fields else None
    kv_heads = _per_block(header, f"{a}.attention.head_count_kv", blocks, default=kv_default)
    for i, (q, kv) in enumerate(zip(heads, kv_heads)):
        if q % kv:
            raise GgufFileError(header.path, f"metadata '{a}.attention.head_count_kv'",
                                f"{kv} KV heads beside {q} query heads (block {i})", "a divisor of the head count")
    head_default = embedding // heads[0] if embedding % heads[0] == 0 else None
    if head_default is None and f"{a}.attention.key_length" not in header.fields:
        raise GgufFileError(header.path, f"metadata '{a}.embedding_length'", f"{embedding}, not divisible by "
                            f"{heads[0]} heads, and no '{a}.attention.key_length'", "a head size")
    key_length = _integer(header, f"{a}.attention.key_length", default=head_default)
    value_length = _integer(header, f"{a}.attention.value_length", default=key_length)
    rope_dims = _integer(header, f"{a}.rope.dimension_count", default=key_length)
    if rope_dims > key_length or rope_dims % 2:
        _fail_key(header, f"{a}.rope.dimension_count", rope_dims, f"an even number ≤ the head size {key_length}")
    _integer(header, f"{a}.context_length", least=1, most=1 << 24)
    # A rope base at or below 1 (1e-38 passed "positive") sends the rotation to infinity; a NaN scaling
    # factor or a zero or NaN soft cap divides by it: each makes every logit NaN at the first token.
    for key, low, high in ((f"{a}.rope.freq_base", 1.0, math.inf), (f"{a}.attention.layer_norm_rms_epsilon", 0.0, 1.0),
                           (f"{a}.attn_logit_softcapping", 0.0, math.inf)):
        _positive_float(header, key, low, high)
    factor = header.fields.get(f"{a}.rope.scaling.factor")  # 0: no scaling, as llama.cpp reads it
    if factor is not None and factor != 0:
        _positive_float(header, f"{a}.rope.scaling.factor", 0.0, math.inf)
    if f"{a}.attention.sliding_window" in header.fields:  # the engine takes it as a 32-bit int; 0 is no window
        _integer(header, f"{a}.attention.sliding_window", least=0, most=(1 << 31) - 1)  # (Phi-4's files mark it so)
    vocabulary = _vocabulary(header, a)
    return ModelSizes(blocks, embedding, feed_forward, heads, kv_heads, key_length, value_length, rope_dims,
                      vocabulary, experts)


def _vocabulary(header: GgufHeader, architecture: str) -> int:
    """The vocabulary: the token list's length, which ``{arch}.vocab_size`` (where given), the
    tokenizer's per-token arrays and its special token ids must agree with."""
    tokens = header.fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GgufArray) or tokens.item_type != _STRING or tokens.count < 1:
        _fail_key(header, "tokenizer.ggml.tokens", tokens, "the token list (an array of strings)")
    vocabulary = tokens.count
    key = f"{architecture}.vocab_size"
    if key in header.fields and _integer(header, key) != vocabulary:
        raise GgufFileError(header.path, f"metadata {key!r}", f"{header.fields[key]}",
                            f"the token list's length {vocabulary} (tokenizer.ggml.tokens)")
    for name in ("scores", "token_type"):
        array = header.fields.get(f"tokenizer.ggml.{name}")
        if array is not None and (not isinstance(array, GgufArray) or array.count != vocabulary):
            _fail_key(header, f"tokenizer.ggml.{name}", array, f"an array of {vocabulary} (one per token)")
    for name in ("bos", "eos", "unknown", "padding", "sep", "cls", "mask", "eot", "eom"):
        key = f"tokenizer.ggml.{name}_token_id"
        if key in header.fields:
            _integer(header, key, least=0, most=vocabulary - 1)
    return vocabulary


def _expected_shapes(architecture: str, sizes: ModelSizes) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """(tensor name → dims in ggml's order, the names that may be absent) for ``architecture``
    with ``sizes``. Which tensors exist comes from gguf-py's ``MODEL_TENSORS``; their shapes are
    those llama.cpp's model loader creates them with."""
    import gguf

    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == architecture)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    E, V, dk, dv = sizes.embedding, sizes.vocabulary, sizes.key_length, sizes.value_length
    shapes: dict[str, tuple[int, ...]] = {"token_embd": (E, V), "output_norm": (E,), "output": (E, V)}
    optional = {"output"}  # absent: tied to the embedding
    for name in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        shapes[name] = (sizes.rope_dims // 2,)
        optional.add(name)
    for i in range(sizes.blocks):
        H, K, F = sizes.heads[i], sizes.kv_heads[i], sizes.feed_forward[i]
        block = {"attn_norm": (E,), "attn_q": (E, H * dk), "attn_k": (E, K * dk), "attn_v": (E, K * dv),
                 "attn_output": (H * dv, E), "ffn_norm": (E,)}
        if sizes.experts:
            X = sizes.experts
            block.update({"ffn_gate_inp": (E, X), "ffn_gate_exps": (E, F, X), "ffn_up_exps": (E, F, X),
                          "ffn_down_exps": (F, E, X)})
        elif architecture == "phi3":
            block.update({"ffn_up": (E, 2 * F), "ffn_down": (F, E)})  # gate and up in one tensor
        else:
            block.update({"ffn_gate": (E, F), "ffn_up": (E, F), "ffn_down": (F, E)})
        if architecture in ("qwen3", "gemma3"):
            block.update({"attn_q_norm": (dk,), "attn_k_norm": (dk,)})
        if architecture == "gemma3":
            block.update({"post_attention_norm": (E,), "post_ffw_norm": (E,)})
        for name, dims in block.items():
            shapes[f"blk.{i}.{name}"] = dims
        if architecture == "phi3":  # q, k and v in one tensor, or apart
            shapes[f"blk.{i}.attn_qkv"] = (E, H * dk + 2 * K * dk)
            fused = {f"blk.{i}.{name}" for name in ("attn_q", "attn_k", "attn_v")}
            optional |= fused | {f"blk.{i}.attn_qkv"}
    # Only the tensors gguf lists for this architecture (the rope factors are phi3's, not llama's).
    listed = {name: dims for name, dims in shapes.items() if _BLOCK.sub("blk.{bid}.", name) in known}
    assert set(shapes) - set(listed) <= optional, f"{architecture}: a required tensor gguf does not list"
    return listed, optional


def _check_tensor_set(header: GgufHeader, architecture: str, sizes: ModelSizes) -> None:
    """Exactly the tensors of ``architecture`` (weights, and biases of their output size where
    present), each of the shape the metadata implies."""
    shapes, optional = _expected_shapes(architecture, sizes)
    path = header.path
    for name, tensor in header.tensors.items():
        base, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias") or base not in shapes:
            raise GgufFileError(path, f"tensor {name!r}", f"not a tensor of a {architecture} model of {sizes.blocks} "
                                "blocks", f"only {architecture}'s tensors (gguf.MODEL_TENSORS) for blk.0 to "
                                f"blk.{sizes.blocks - 1}")
        want = shapes[base] if kind == "weight" else shapes[base][1:2] or shapes[base][:1]
        if tensor.type_name in _INTEGER_TENSOR_TYPES:  # the same bytes as F32 / F16 pass the layout check
            raise GgufFileError(path, f"tensor {name!r}", f"of type {tensor.type_name}",
                                "float or quantised weights (F32, F16, BF16, Q*_*, IQ*): integers are not weights")
        if tensor.dims != want:
            raise GgufFileError(path, f"tensor {name!r}", f"shape {list(tensor.dims)}",
                                f"{list(want)} from the metadata ({_sizes_text(architecture, sizes)})")
    for base in shapes:
        if base not in optional and f"{base}.weight" not in header.tensors:
            raise GgufFileError(path, f"tensor '{base}.weight'", "missing",
                                f"every tensor of a {architecture} model of {sizes.blocks} blocks")
    if architecture == "phi3":
        for i in range(sizes.blocks):
            parts = [f"blk.{i}.{n}.weight" in header.tensors for n in ("attn_q", "attn_k", "attn_v")]
            if f"blk.{i}.attn_qkv.weight" not in header.tensors and not all(parts):
                raise GgufFileError(path, f"tensor 'blk.{i}.attn_qkv.weight'", "missing (and q, k, v not apart)",
                                    "attn_qkv or all of attn_q, attn_k, attn_v")


def _sizes_text(architecture: str, sizes: ModelSizes) -> str:
    return (f"embedding {sizes.embedding}, feed-forward {sizes.feed_forward[0]}, {sizes.heads[0]} heads, "
            f"{sizes.kv_heads[0]} KV heads, head size {sizes.key_length}, vocabulary {sizes.vocabulary}")
