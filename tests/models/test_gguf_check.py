"""GGUF files checked before any work (issue 40, item 1): a corpus of damaged variants of tiny GGUF
files written here with gguf-py's writer, each refused with its exact one-line message; sound files
of every checked architecture pass; the default model's file passes, and damaged copies of it are
refused by ``load_model`` and the CLI from the header alone, nothing converted."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize

from tierspec.gguf_check import GgufFileError, check_gguf, read_header
from tierspec.quant import read_gguf_tensors

E, H, KV, F, V, BLOCKS = 64, 4, 2, 96, 64, 2


def write_model(path: Path, arch: str = "llama", blocks: int = BLOCKS, head_dim: int | None = None, tied: bool = True,
                fused_qkv: bool = False, drop: tuple[str, ...] = (), extra: dict | None = None,
                tokens: list | None = None, metadata=None, nan_norm: bool = False) -> Path:
    """A tiny model of ``arch`` as llama.cpp lays it out: Q8_0 embedding, Q4_1 projections, F32
    norms (as the default model's file has them). ``drop``: tensors left out; ``extra``: tensors
    added (name → numpy float32 array); ``metadata(writer)``: more keys."""
    rng = np.random.default_rng(0)
    dk = head_dim or E // H
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(E)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(KV)
    if head_dim:
        writer.add_key_length(dk)
        writer.add_value_length(dk)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens if tokens is not None else [f"<t{i}>" for i in range(V)])
    writer.add_eos_token_id(1)
    if metadata:
        metadata(writer)

    def add(name: str, shape: tuple[int, ...], kind=Q.Q4_1):
        if name in drop:
            return
        values = rng.standard_normal(shape).astype(np.float32)
        if len(shape) == 1:
            values = 1 + 0.1 * values
            if nan_norm and name == "blk.1.ffn_norm.weight":
                values[7] = np.nan
            writer.add_tensor(name, values, raw_dtype=Q.F32)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    add("token_embd.weight", (V, E), Q.Q8_0)  # numpy order: [rows, row length] = ggml's dims reversed
    for i in range(blocks):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (E,))
        if fused_qkv:
            add(b + "attn_qkv.weight", (H * dk + 2 * KV * dk, E))
        else:
            add(b + "attn_q.weight", (H * dk, E))
            add(b + "attn_k.weight", (KV * dk, E))
            add(b + "attn_v.weight", (KV * dk, E))
        add(b + "attn_output.weight", (E, H * dk))
        if arch in ("qwen3", "gemma3"):
            add(b + "attn_q_norm.weight", (dk,))
            add(b + "attn_k_norm.weight", (dk,))
        if arch == "gemma3":
            add(b + "post_attention_norm.weight", (E,))
            add(b + "post_ffw_norm.weight", (E,))
        add(b + "ffn_norm.weight", (E,))
        if arch == "phi3":
            add(b + "ffn_up.weight", (2 * F, E))
        else:
            add(b + "ffn_gate.weight", (F, E))
            add(b + "ffn_up.weight", (F, E))
        add(b + "ffn_down.weight", (E, F))
        if arch == "qwen2":
            for part, rows in (("attn_q", H * dk), ("attn_k", KV * dk), ("attn_v", KV * dk)):
                if b + part + ".bias" not in drop:
                    writer.add_tensor(b + part + ".bias", np.zeros(rows, np.float32), raw_dtype=Q.F32)
    add("output_norm.weight", (E,))
    if not tied:
        add("output.weight", (V, E), Q.Q8_0)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- where things are in a file (found with gguf-py's own reader, independently of gguf_check) ----


def value_at(path: Path, key: str) -> int:
    """The file offset of metadata ``key``'s value (after its key and value type)."""
    field = GGUFReader(path).fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def key_at(path: Path, key: str) -> int:
    """The file offset of metadata ``key``'s key length."""
    return GGUFReader(path).fields[key].offset


def tensor_at(path: Path, name: str) -> dict[str, int]:
    """File offsets of tensor ``name``'s info: its name length, n_dims, dims, type and data offset."""
    reader = GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    start = tensor.field.offset
    n_dims = start + 8 + len(name.encode())
    count = len(tensor.shape)
    return {"name": start, "n_dims": n_dims, "dims": n_dims + 4, "type": n_dims + 4 + 8 * count,
            "offset": n_dims + 4 + 8 * count + 4, "data": int(tensor.data_offset), "nbytes": int(tensor.n_bytes)}


def patched(path: Path, out: Path, *patches: tuple[int, str, object]) -> Path:
    data = bytearray(path.read_bytes())
    for offset, fmt, value in patches:
        struct.pack_into(fmt, data, offset, value)
    out.write_bytes(bytes(data))
    return out


def refused(path: Path) -> str:
    """The one-line message ``check_gguf`` refuses ``path`` with, without the path prefix."""
    with pytest.raises(GgufFileError) as caught:
        check_gguf(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message[len(f"{path}: "):]


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("gguf") / "sound.gguf")


# ---- sound files pass -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch, options", [
    ("llama", {}), ("llama", {"tied": False}),  # Mistral 7B files are llama files, untied
    ("qwen2", {"tied": False}), ("qwen3", {}), ("gemma3", {"head_dim": 32}),
    ("phi3", {"fused_qkv": True, "tied": False}), ("phi3", {}),
    ("llama", {"extra": {"rope_freqs.weight": np.ones(8, np.float32)}}),  # Llama 3.1's rope factors
    # Phi-4's converter writes a window of 0 (no window), and llama.cpp reads a scaling factor of 0 as none
    ("phi3", {"metadata": lambda w: w.add_uint32("phi3.attention.sliding_window", 0)}),
    ("llama", {"metadata": lambda w: w.add_float32("llama.rope.scaling.factor", 0.0)}),
])
def test_sound_files_of_every_checked_architecture_pass(tmp_path, arch, options):
    path = write_model(tmp_path / f"{arch}.gguf", arch, **options)
    header = check_gguf(path)
    assert header.architecture == arch and header.fields[f"{arch}.block_count"] == BLOCKS
    reference = {t.name: (t.tensor_type, t.data_offset, t.n_bytes) for t in GGUFReader(path).tensors}
    assert {name: (t.ggml_type, t.offset, t.nbytes) for name, t in header.tensors.items()} == reference
    assert header.array("tokenizer.ggml.tokens") == [f"<t{i}>" for i in range(V)]


def test_a_q4_k_m_files_sizes_are_its_super_blocks(tmp_path):
    """K-quant tensors (super-blocks of 256 values: Q4_K 144 bytes, Q6_K 210) sized as gguf-py reads
    them, so the engine's repacking reads each tensor's bytes and no more."""
    from arch_models import write_arch_gguf

    path = write_arch_gguf(tmp_path, "llama3", "Q4_K_M").gguf
    header = check_gguf(path)
    reference = {t.name: (t.tensor_type, t.data_offset, t.n_bytes) for t in GGUFReader(path).tensors}
    assert {name: (t.ggml_type, t.offset, t.nbytes) for name, t in header.tensors.items()} == reference
    assert header.tensors["blk.0.attn_q.weight"].ggml_type == Q.Q4_K
    assert header.tensors["blk.0.attn_q.weight"].nbytes == 256 * 256 // 256 * 144  # [256 rows, 256 values]
    assert header.tensors["blk.2.ffn_down.weight"].ggml_type == Q.Q6_K
    assert header.tensors["blk.2.ffn_down.weight"].nbytes == 256 * 512 // 256 * 210


def test_an_unknown_architecture_gets_the_generic_checks(tmp_path):
    path = write_model(tmp_path / "other.gguf", "gpt2", extra={"whatever.weight": np.ones(32, np.float32)})
    assert check_gguf(path).architecture == "gpt2"
    first = tensor_at(path, "token_embd.weight")
    bad = patched(path, tmp_path / "bad.gguf", (tensor_at(path, "blk.0.attn_norm.weight")["offset"], "<Q", 0))
    assert refused(bad).startswith("tensor 'blk.0.attn_norm.weight': F32 [64] (256 bytes at offset "
                                   f"{first['data']}) overlaps tensor 'token_embd.weight'")


def test_the_reader_maps_exactly_the_checked_regions(sound):
    """quant.read_gguf_tensors (what the engine repacks from) gives each tensor a view of exactly
    its own bytes: a validated header cannot make the repacking read past a buffer."""
    tensors, fields = read_gguf_tensors(sound)
    header = check_gguf(sound)
    raw = np.fromfile(sound, dtype=np.uint8)
    for name, info in header.tensors.items():
        data = tensors[name].data
        assert data.nbytes == info.nbytes
        assert np.array_equal(data.view(np.uint8).reshape(-1), raw[info.offset: info.offset + info.nbytes])
    assert fields["llama.block_count"] == BLOCKS and "tokenizer.ggml.tokens" not in fields


# ---- the damaged corpus ------------------------------------------------------------------------------

# Each damage: (id, make(sound file, out path) → damaged file, expected message with {placeholders}
# filled from the sound file's facts).


def _facts(path: Path) -> dict:
    size = path.stat().st_size
    up = tensor_at(path, "blk.0.ffn_up.weight")
    return {"size": size, "up": up, "embd": tensor_at(path, "token_embd.weight"),
            "norm": tensor_at(path, "blk.1.ffn_norm.weight"), "q": tensor_at(path, "blk.0.attn_q.weight"),
            "k": tensor_at(path, "blk.0.attn_k.weight"), "last": tensor_at(path, "output_norm.weight")}


def _tensor_after(path: Path, name: str) -> str:
    reader = GGUFReader(path)
    ordered = sorted(reader.tensors, key=lambda t: t.data_offset)
    return next(b.name for a, b in zip(ordered, ordered[1:]) if a.name == name)


def _header_end(path: Path) -> int:
    return check_gguf(path).data_offset


MESSAGES = {
    "block_count_0": "metadata 'llama.block_count': 0, but the file holds the tensors of 2 blocks (blk.0 to blk.1); "
                     "expected the number of blocks whose tensors the file holds (2, with every block from blk.0)",
    "block_count_1000": "metadata 'llama.block_count': 1000, but the file holds the tensors of 2 blocks (blk.0 to "
                        "blk.1); expected the number of blocks whose tensors the file holds (2, with every block from "
                        "blk.0)",
    "bad_magic": "the magic: b'GGUL'; expected b'GGUF' (not a GGUF file?)",
    "empty_file": "the magic: an empty file; expected b'GGUF' (not a GGUF file?)",
    "version_1": "the version: 1; expected one of 2, 3",
    "version_4": "the version: 4; expected one of 2, 3",
    "alignment_0": "metadata 'general.alignment': 0; expected a power of two (32 by default)",
    "alignment_3": "metadata 'general.alignment': 3; expected a power of two (32 by default)",
    "unknown_ggml_type": "tensor 'blk.0.ffn_up.weight': ggml type id 99; expected a known ggml type "
                         "(gguf.GGMLQuantizationType)",
    "unknown_value_type": "metadata 'llama.block_count': value type 77; expected one of the GGUF value types 0–12",
    "five_dims": "tensor 'blk.0.ffn_up.weight': 5 dimensions; expected 1 to 4",
    "zero_dim": "tensor 'blk.0.ffn_up.weight': dimensions [0, 96]; expected every dimension at least 1",
    "shape_overflow": "tensor 'blk.0.ffn_up.weight': dimensions [64, 4611686018427387904] "
                      "(295147905179352825856 values); expected fewer than 2^63 values",
    "partial_block": "tensor 'blk.0.ffn_up.weight': rows of 48 Q4_1 values; expected a multiple of its block of 32",
    "duplicate_name": "tensor 'blk.0.attn_q.weight': a name used twice; expected each tensor named once",
    "duplicate_key": "metadata 'llama.context_length': a key written twice; expected each key once",
    "head_count_0": "metadata 'llama.attention.head_count': 0; expected an integer from 1 to 2147483648",
    "kv_heads_3": "metadata 'llama.attention.head_count_kv': 3 KV heads beside 4 query heads (block 0); expected a "
                  "divisor of the head count",
    "block_count_float": "metadata 'llama.block_count': 30.0; expected an integer",
    "context_length_0": "metadata 'llama.context_length': 0; expected an integer from 1 to 16777216",
    "rms_epsilon_nan": "metadata 'llama.attention.layer_norm_rms_epsilon': nan; expected a finite number in (0, 1)",
    "rope_base_0": "metadata 'llama.rope.freq_base': 0.0; expected a finite number in (1, inf)",
    "rope_base_tiny": "metadata 'llama.rope.freq_base': 9.999999350456404e-39; expected a finite number in (1, inf)",
    "rope_scaling_nan": "metadata 'llama.rope.scaling.factor': nan; expected a finite number in (0, inf)",
    "softcap_0": "metadata 'llama.attn_logit_softcapping': 0.0; expected a finite number in (0, inf)",
    "sliding_window_negative": "metadata 'llama.attention.sliding_window': -1; expected an integer from 0 to 2147483647",
    "sliding_window_2_31": "metadata 'llama.attention.sliding_window': 2147483648; expected an integer from 0 to "
                           "2147483647",
    "sliding_window_float": "metadata 'llama.attention.sliding_window': 512.0; expected an integer",
    "integer_norm": "tensor 'blk.0.attn_norm.weight': of type I32; expected float or quantised weights (F32, F16, BF16, "
                    "Q*_*, IQ*): integers are not weights",
    "eos_outside": "metadata 'tokenizer.ggml.eos_token_id': 64; expected an integer from 0 to 63",
    "vocab_size_key": "metadata 'llama.vocab_size': 65; expected the token list's length 64 (tokenizer.ggml.tokens)",
    "nan_norm": "tensor 'blk.1.ffn_norm.weight': 1 non-finite values (the first, nan, at index 7); expected finite "
                "values",
    "missing_tensor": "tensor 'blk.1.ffn_norm.weight': missing; expected every tensor of a llama model of 2 blocks",
    "unknown_tensor": "tensor 'blk.0.attn_zzz.weight': not a tensor of a llama model of 2 blocks; expected only "
                      "llama's tensors (gguf.MODEL_TENSORS) for blk.0 to blk.1",
    "missing_block": "metadata 'llama.block_count': 3, but the file holds tensors of blocks 0, 2; expected the number "
                     "of blocks whose tensors the file holds (3, with every block from blk.0)",
    "no_token_list": "metadata 'tokenizer.ggml.tokens': missing; expected the token list (an array of strings)",
    "no_architecture": "metadata 'general.architecture': missing; expected the architecture's name (text)",
    "no_embedding_length": "metadata 'llama.embedding_length': missing; expected an integer ≥ 1 (the model cannot be "
                           "built without it)",
}


def damage_cases():
    """(id, make(sound, tmp) → path, expected(path, sound) → message)."""
    fixed = lambda key: (lambda path, sound: MESSAGES[key])  # noqa: E731

    def patch(*items):
        def make(sound, tmp):
            return patched(sound, tmp / "damaged.gguf", *[(at(sound), fmt, value) for at, fmt, value in items])
        return make

    def meta(key, fmt, value):
        return patch((lambda s: value_at(s, key), fmt, value))

    def info(name, part, fmt, value, plus=0):
        return patch((lambda s: tensor_at(s, name)[part] + plus, fmt, value))

    def written(**options):
        return lambda sound, tmp: write_model(tmp / "damaged.gguf", **options)

    def cut(at):
        def make(sound, tmp):
            out = tmp / "damaged.gguf"
            out.write_bytes(sound.read_bytes()[: at(sound)])
            return out
        return make

    up = "blk.0.ffn_up.weight"
    yield "block_count_0", meta("llama.block_count", "<I", 0), fixed("block_count_0")
    yield "block_count_1000", meta("llama.block_count", "<I", 1000), fixed("block_count_1000")
    def block_count_off_by_one(count):
        return lambda path, sound: (
            f"metadata 'llama.block_count': {count}, but the file holds the tensors of {BLOCKS} blocks (blk.0 to "
            f"blk.{BLOCKS - 1}); expected the number of blocks whose tensors the file holds ({BLOCKS}, with every "
            "block from blk.0)")
    yield "block_count_minus_1", meta("llama.block_count", "<I", BLOCKS - 1), block_count_off_by_one(BLOCKS - 1)
    yield "block_count_plus_1", meta("llama.block_count", "<I", BLOCKS + 1), block_count_off_by_one(BLOCKS + 1)
    yield "missing_block", written(blocks=3, drop=tuple(n for n in _all_names(3) if n.startswith("blk.1."))), \
        fixed("missing_block")

    # The layout: a data offset moved onto another tensor; a type changed to a larger or smaller one.
    def overlap_message(path, sound):
        f = _facts(sound)
        moved, onto = f["up"], f["embd"]
        return (f"tensor 'blk.0.ffn_up.weight': Q4_1 [64, 96] ({moved['nbytes']} bytes at offset {onto['data']}) "
                f"overlaps tensor 'token_embd.weight', Q8_0 [64, 64] ({onto['nbytes']} bytes at offset {onto['data']}); "
                "expected each tensor's bytes its own")
    yield "offset_overlaps", info(up, "offset", "<Q", 0), overlap_message

    def larger_type_message(new_type, new_bytes):
        def message(path, sound):
            f = _facts(sound)
            nxt = _tensor_after(sound, up)
            n = tensor_at(sound, nxt)
            kind = {8: "Q8_0", 0: "F32"}[new_type]
            return (f"tensor {nxt!r}: {_type_dims(sound, nxt)} ({n['nbytes']} bytes at offset {n['data']}) overlaps "
                    f"tensor '{up}', {kind} [64, 96] ({new_bytes} bytes at offset {f['up']['data']}); expected each "
                    "tensor's bytes its own")
        return message
    yield "q4_1_to_q8_0", info(up, "type", "<I", 8), larger_type_message(8, 96 * 2 * 34)
    yield "q4_1_to_f32", info(up, "type", "<I", 0), larger_type_message(0, 96 * 64 * 4)

    def smaller_type_message(path, sound):
        f = _facts(sound)
        nxt = _tensor_after(sound, "token_embd.weight")
        return (f"tensor 'token_embd.weight': Q4_1 [64, 64] ({64 * 2 * 20} bytes at offset {f['embd']['data']}) is "
                f"followed by {f['embd']['nbytes'] - 64 * 2 * 20} unused bytes before tensor {nxt!r}; expected its "
                "type and shape to fill its data (changed type or shape?)")
    yield "embedding_q8_0_to_q4_1", info("token_embd.weight", "type", "<I", 3), smaller_type_message

    def last_smaller_message(path, sound):
        f = _facts(sound)
        # the last tensor (output_norm, F32 [64]) read as F16: half its bytes, the rest left at the end
        return (f"tensor 'output_norm.weight': F16 [64] (128 bytes at offset {f['last']['data']}) is followed by 128 "
                "bytes at the end of the file; expected its type and shape to fill the file's data (changed type or "
                "shape, or bytes appended?)")
    yield "last_tensor_smaller", info("output_norm.weight", "type", "<I", 1), last_smaller_message

    def misaligned_message(path, sound):
        f = _facts(sound)
        return f"tensor '{up}': data offset {f['up']['data'] - _header_end(sound) + 4}; expected a multiple of the alignment 32"
    yield "misaligned_offset", _misaligned(up), misaligned_message

    # Cut short: in the data, in the tensor infos, in the metadata.
    def past_end_message(path, sound):
        f = _facts(sound)
        return (f"tensor 'output_norm.weight': F32 [64] (256 bytes at offset {f['last']['data']}) reaches past the end "
                f"of the file at {f['size'] - 100}; expected its data inside the file (the file is cut short?)")
    yield "truncated_data", cut(lambda s: s.stat().st_size - 100), past_end_message

    def header_cut_message(path, sound):
        at = tensor_at(sound, up)["type"] + 2
        return f"tensor '{up}': the file ends at byte {at}; expected 4 bytes at byte {at - 2} (the file is cut short)"
    yield "truncated_header", cut(lambda s: tensor_at(s, up)["type"] + 2), header_cut_message

    # Counts and lengths bounded before anything is allocated.
    def huge_string_message(path, sound):
        at = key_at(sound, "general.architecture")
        left = sound.stat().st_size - at - 8
        return (f"metadata key #0: a string length of {2**63}; expected at most {left} (what the {left} bytes left in "
                "the file hold)")
    yield "huge_string_length", patch((lambda s: key_at(s, "general.architecture"), "<Q", 2**63)), huge_string_message

    def huge_array_message(path, sound):
        at = value_at(sound, "tokenizer.ggml.tokens") + 4 + 8
        left = sound.stat().st_size - at
        return (f"metadata 'tokenizer.ggml.tokens': an array count of {2**60}; expected at most {left // 8} (what the "
                f"{left} bytes left in the file hold)")
    yield "huge_array_count", patch((lambda s: value_at(s, "tokenizer.ggml.tokens") + 4, "<Q", 2**60)), huge_array_message

    def huge_tensor_count_message(path, sound):
        left = sound.stat().st_size - 24
        return f"the tensor count: {2**50}; expected at most {left // 32} (what the rest of the file holds)"
    yield "huge_tensor_count", patch((lambda s: 8, "<Q", 2**50)), huge_tensor_count_message

    def huge_field_count_message(path, sound):
        left = sound.stat().st_size - 24
        return f"the metadata count: a count of {2**62}; expected at most {left // 13} (what the {left} bytes left in the file hold)"
    yield "huge_field_count", patch((lambda s: 16, "<Q", 2**62)), huge_field_count_message

    def tensor_count_plus_one_message(path, sound):  # the padding before the data read as a name
        return f"tensor #{_tensor_count(sound)}'s name: an empty name; expected a name of 1 to 63 bytes"
    yield "tensor_count_plus_one", lambda sound, tmp: patched(sound, tmp / "damaged.gguf",
                                                              (8, "<Q", _tensor_count(sound) + 1)), \
        tensor_count_plus_one_message

    def long_name_message(path, sound):
        return "tensor #0's name: a name of 100 bytes; expected at most 63"
    yield "tensor_name_too_long", patch((lambda s: tensor_at(s, "token_embd.weight")["name"], "<Q", 100)), long_name_message

    yield "bad_magic", patch((lambda s: 0, "4s", b"GGUL")), fixed("bad_magic")
    yield "empty_file", cut(lambda s: 0), fixed("empty_file")
    yield "version_1", patch((lambda s: 4, "<I", 1)), fixed("version_1")
    yield "version_4", patch((lambda s: 4, "<I", 4)), fixed("version_4")
    yield "unknown_ggml_type", info(up, "type", "<I", 99), fixed("unknown_ggml_type")
    yield "unknown_value_type", patch((lambda s: value_at(s, "llama.block_count") - 4, "<I", 77)), \
        fixed("unknown_value_type")
    yield "five_dims", info(up, "n_dims", "<I", 5), fixed("five_dims")
    yield "zero_dim", info(up, "dims", "<Q", 0), fixed("zero_dim")
    yield "shape_overflow", info(up, "dims", "<Q", 2**62, plus=8), fixed("shape_overflow")
    yield "partial_block", patch((lambda s: tensor_at(s, up)["dims"], "<Q", 48), (lambda s: tensor_at(s, up)["dims"] + 8,
                                                                                  "<Q", 128)), fixed("partial_block")
    yield "duplicate_name", patch((lambda s: tensor_at(s, "blk.0.attn_k.weight")["name"] + 8 + 11, "1s", b"q")), \
        fixed("duplicate_name")
    yield "duplicate_key", patch((lambda s: key_at(s, "tokenizer.ggml.model") + 8, "20s", b"llama.context_length")), \
        fixed("duplicate_key")
    yield "alignment_0", written(metadata=lambda w: w.add_uint32("general.alignment", 0)), fixed("alignment_0")
    yield "alignment_3", written(metadata=lambda w: w.add_uint32("general.alignment", 3)), fixed("alignment_3")
    yield "head_count_0", meta("llama.attention.head_count", "<I", 0), fixed("head_count_0")
    yield "kv_heads_3", meta("llama.attention.head_count_kv", "<I", 3), fixed("kv_heads_3")
    yield "block_count_float", patch((lambda s: value_at(s, "llama.block_count") - 4, "<I", 6),
                                     (lambda s: value_at(s, "llama.block_count"), "<f", 30.0)), fixed("block_count_float")
    yield "eos_outside", meta("tokenizer.ggml.eos_token_id", "<I", 64), fixed("eos_outside")
    yield "context_length_0", meta("llama.context_length", "<I", 0), fixed("context_length_0")
    # a context of 2^31 would have the rotary tables and the cache sized from it
    yield "context_length_huge", meta("llama.context_length", "<I", 2**31), \
        lambda path, sound: "metadata 'llama.context_length': 2147483648; expected an integer from 1 to 16777216"
    yield "vocab_size_0", written(metadata=lambda w: w.add_vocab_size(0)), \
        lambda path, sound: "metadata 'llama.vocab_size': 0; expected an integer from 1 to 2147483648"

    def three_dims_message(path, sound):
        # the third dimension is read from the type and the offset's low half, the type from the offset's high
        # half, the offset from the next tensor info's name length: caught as a misaligned offset
        reader = GGUFReader(sound)
        after = reader.tensors[[t.name for t in reader.tensors].index(up) + 1].name
        return f"tensor '{up}': data offset {len(after)}; expected a multiple of the alignment 32"
    yield "n_dims_2_to_3", info(up, "n_dims", "<I", 3), three_dims_message
    yield "rms_epsilon_nan", meta("llama.attention.layer_norm_rms_epsilon", "<f", float("nan")), fixed("rms_epsilon_nan")
    yield "rope_base_0", written(metadata=lambda w: w.add_rope_freq_base(0.0)), fixed("rope_base_0")
    # each of these made every logit NaN at the first token (a base of 1e-38 passed "positive")
    yield "rope_base_tiny", written(metadata=lambda w: w.add_rope_freq_base(1e-38)), fixed("rope_base_tiny")
    yield "rope_scaling_nan", written(metadata=lambda w: w.add_float32("llama.rope.scaling.factor", float("nan"))), \
        fixed("rope_scaling_nan")
    yield "softcap_0", written(metadata=lambda w: w.add_float32("llama.attn_logit_softcapping", 0.0)), fixed("softcap_0")
    # a window of -1 loaded and wrote garbage; 2^31 was an OverflowError from the engine
    yield "sliding_window_negative", written(metadata=lambda w: w.add_int32("llama.attention.sliding_window", -1)), \
        fixed("sliding_window_negative")
    yield "sliding_window_2_31", written(metadata=lambda w: w.add_uint32("llama.attention.sliding_window", 2**31)), \
        fixed("sliding_window_2_31")
    yield "sliding_window_float", written(metadata=lambda w: w.add_float32("llama.attention.sliding_window", 512.0)), \
        fixed("sliding_window_float")
    # F32 → I32 keeps every size: gguf-py's "Dequantization for I32 is not yet implemented" at load
    yield "integer_norm", info("blk.0.attn_norm.weight", "type", "<I", 26), fixed("integer_norm")
    yield "vocab_size_key", written(metadata=lambda w: w.add_vocab_size(65)), fixed("vocab_size_key")
    yield "nan_norm", written(nan_norm=True), fixed("nan_norm")
    yield "missing_tensor", written(drop=("blk.1.ffn_norm.weight",)), fixed("missing_tensor")
    yield "unknown_tensor", written(extra={"blk.0.attn_zzz.weight": np.ones(64, np.float32)}), fixed("unknown_tensor")
    yield "no_token_list", _without_key("tokenizer.ggml.tokens"), fixed("no_token_list")
    yield "no_architecture", _without_key("general.architecture"), fixed("no_architecture")
    yield "no_embedding_length", _without_key("llama.embedding_length"), fixed("no_embedding_length")

    def shape_message(path, sound):
        return ("tensor 'token_embd.weight': shape [64, 64]; expected [128, 64] from the metadata (embedding 128, "
                "feed-forward 96, 4 heads, 2 KV heads, head size 32, vocabulary 64)")
    yield "embedding_length_changed", meta("llama.embedding_length", "<I", 128), shape_message

    def kv_shape_message(path, sound):
        return ("tensor 'blk.0.attn_k.weight': shape [64, 32]; expected [64, 64] from the metadata (embedding 64, "
                "feed-forward 96, 4 heads, 4 KV heads, head size 16, vocabulary 64)")
    yield "kv_heads_changed", meta("llama.attention.head_count_kv", "<I", 4), kv_shape_message

    def vocabulary_message(path, sound):
        return ("tensor 'token_embd.weight': shape [64, 64]; expected [64, 60] from the metadata (embedding 64, "
                "feed-forward 96, 4 heads, 2 KV heads, head size 16, vocabulary 60)")
    yield "vocabulary_mismatch", written(tokens=[f"<t{i}>" for i in range(60)]), vocabulary_message

    def ffn_message(path, sound):
        return ("tensor 'blk.0.ffn_gate.weight': shape [64, 96]; expected [64, 128] from the metadata (embedding 64, "
                "feed-forward 128, 4 heads, 2 KV heads, head size 16, vocabulary 64)")
    yield "feed_forward_changed", meta("llama.feed_forward_length", "<I", 128), ffn_message

    def token_utf8_message(path, sound):
        at = _token_at(sound, 5)
        return (f"metadata 'tokenizer.ggml.tokens'[5]: bytes that are not UTF-8 text (byte 0 of 4, at file offset "
                f"{at + 8}); expected UTF-8 text")
    yield "token_not_utf8", patch((lambda s: _token_at(s, 5) + 8, "1s", b"\xff")), token_utf8_message

    def key_utf8_message(path, sound):
        at = key_at(sound, "llama.block_count")
        return f"metadata key #{_key_index(sound, 'llama.block_count')}: bytes that are not UTF-8 text (byte 0 of 17, " \
               f"at file offset {at + 8}); expected UTF-8 text"
    yield "key_not_utf8", patch((lambda s: key_at(s, "llama.block_count") + 8, "1s", b"\xc3")), key_utf8_message

    def appended_message(path, sound):
        f = _facts(sound)
        return (f"tensor 'output_norm.weight': F32 [64] (256 bytes at offset {f['last']['data']}) is followed by 64 "
                "bytes at the end of the file; expected its type and shape to fill the file's data (changed type or "
                "shape, or bytes appended?)")
    yield "bytes_appended", lambda sound, tmp: _appended(sound, tmp, 64), appended_message


def _all_names(blocks: int) -> list[str]:
    parts = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    return [f"blk.{i}.{p}.weight" for i in range(blocks) for p in parts]


def _type_dims(path: Path, name: str) -> str:
    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    return f"{tensor.tensor_type.name} {[int(d) for d in tensor.shape]}"


def _misaligned(name: str):
    def make(sound, tmp):
        at = tensor_at(sound, name)
        relative = at["data"] - _header_end(sound)
        return patched(sound, tmp / "damaged.gguf", (at["offset"], "<Q", relative + 4))
    return make


def _tensor_count(path: Path) -> int:
    return len(GGUFReader(path).tensors)


def _header_end_unaligned(path: Path) -> int:
    reader = GGUFReader(path)
    last = reader.tensors[-1].field
    return last.offset + sum(int(p.nbytes) for p in last.parts)


def _token_at(path: Path, index: int) -> int:
    """The file offset of token ``index``'s string length in the token list."""
    data = path.read_bytes()
    at = value_at(path, "tokenizer.ggml.tokens") + 4 + 8
    for _ in range(index):
        at += 8 + struct.unpack_from("<Q", data, at)[0]
    return at


def _key_index(path: Path, key: str) -> int:
    return [k for k in GGUFReader(path).fields if not k.startswith("GGUF.")].index(key)


def _appended(sound: Path, tmp: Path, count: int) -> Path:
    out = tmp / "damaged.gguf"
    out.write_bytes(sound.read_bytes() + bytes(count))
    return out


def _without_key(key: str):
    """The sound file written again without metadata ``key`` (the writer's own keys dropped after the fact)."""
    def make(sound, tmp):
        out = tmp / "damaged.gguf"
        data = sound.read_bytes()
        reader = GGUFReader(sound)
        field = reader.fields[key]
        length = sum(int(p.nbytes) for p in field.parts)
        count = struct.unpack_from("<Q", data, 16)[0]
        trimmed = bytearray(data[: field.offset] + data[field.offset + length:])
        struct.pack_into("<Q", trimmed, 16, count - 1)
        # the tensor infos moved up by `length`: the data section keeps its place if padding is added back
        start = _header_end_unaligned(sound) - length
        pad = (-start) % 32 - (-(start + length)) % 32
        if pad >= 0:
            trimmed[start:start] = bytes(pad)
        else:
            del trimmed[start:start - pad]
        out.write_bytes(bytes(trimmed))
        return out
    return make


CASES = list(damage_cases())


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_every_damaged_file_is_refused_with_its_message(sound, tmp_path, case):
    name, make, expected = case
    damaged = make(sound, tmp_path)
    assert refused(damaged) == expected(damaged, sound)


def test_the_corpus_covers_the_issue(sound):
    """The kinds the issue lists are all in the corpus (and more)."""
    names = {case[0] for case in CASES}
    assert {"block_count_0", "block_count_1000", "offset_overlaps", "q4_1_to_q8_0", "q4_1_to_f32",
            "embedding_q8_0_to_q4_1", "truncated_data", "truncated_header", "huge_string_length", "huge_array_count",
            "bad_magic", "version_4", "unknown_ggml_type", "misaligned_offset", "duplicate_name", "shape_overflow",
            "missing_tensor", "embedding_length_changed", "vocabulary_mismatch", "nan_norm", "alignment_0"} <= names
    assert len(names) == len(CASES) >= 50


# ---- the default model's file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_file():
    from tierspec.models import default_model_file

    try:
        return default_model_file()
    except Exception as error:  # noqa: BLE001
        pytest.skip(f"the default model is not installed: {error}")


def test_the_default_model_file_passes_fast(real_file):
    check_gguf(real_file)  # warm: gguf's import, the page cache
    started = time.perf_counter()
    header = check_gguf(real_file)
    seconds = time.perf_counter() - started
    assert header.architecture == "llama" and len(header.tensors) == 272
    assert seconds < 1.0, f"the check took {seconds:.2f} s"


@pytest.fixture(scope="module")
def real_positions(real_file) -> dict:
    """Where the issue's damage goes in the default model's file (one read with gguf-py's reader)."""
    reader = GGUFReader(real_file)

    def value(key):
        return reader.fields[key].offset + 8 + len(key.encode()) + 4

    def info(name):
        tensor = next(t for t in reader.tensors if t.name == name)
        n_dims = tensor.field.offset + 8 + len(name.encode())
        return {"type": n_dims + 4 + 8 * len(tensor.shape), "offset": n_dims + 4 + 8 * len(tensor.shape) + 4}

    return {"block_count": value("llama.block_count"), "tokens": value("tokenizer.ggml.tokens"),
            "up": info("blk.0.ffn_up.weight"), "embd": info("token_embd.weight")}


def _real_variants(at: dict):
    """Damaged copies of the default model's file, as the issue made them: (patches, message part)."""
    up = "blk.0.ffn_up.weight"
    return {
        "block_count_0": ([(at["block_count"], "<I", 0)],
                          "metadata 'llama.block_count': 0, but the file holds the tensors of 30 blocks"),
        "block_count_1000": ([(at["block_count"], "<I", 1000)],
                             "metadata 'llama.block_count': 1000, but the file holds the tensors of 30 blocks"),
        "offset_overlaps": ([(at["up"]["offset"], "<Q", 0)],
                            f"tensor '{up}': Q4_1 [576, 1536] (552960 bytes at offset 1785664) overlaps tensor "
                            "'token_embd.weight'"),
        "q4_1_to_q8_0": ([(at["up"]["type"], "<I", 8)], f"overlaps tensor '{up}', Q8_0"),
        "q4_1_to_f32": ([(at["up"]["type"], "<I", 0)], f"overlaps tensor '{up}', F32"),
        "embedding_q8_0_to_q4_1": ([(at["embd"]["type"], "<I", 3)],
                                   "tensor 'token_embd.weight': Q4_1 [576, 49152] (17694720 bytes at offset 1785664) is "
                                   "followed by 12386304 unused bytes before tensor 'blk.0.attn_norm.weight'"),
        # one token more: the next key is read as a token, then a value type and item type as a string length
        "token_count": ([(at["tokens"] + 4, "<Q", 49153)],
                        "metadata key #25: a string length of 21474836489; expected at most 97598898"),
    }


@pytest.fixture(scope="module")
def real_bytes(real_file) -> bytes:
    return real_file.read_bytes()


@pytest.mark.parametrize("variant", ["block_count_0", "block_count_1000", "offset_overlaps", "q4_1_to_q8_0",
                                     "q4_1_to_f32", "embedding_q8_0_to_q4_1", "token_count"])
def test_damaged_copies_of_the_default_file_are_refused_by_load_model(real_bytes, real_positions, tmp_path,
                                                                       monkeypatch, variant):
    from tierspec.models import load_model

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    patches, message = _real_variants(real_positions)[variant]
    data = bytearray(real_bytes)
    for offset, fmt, value in patches:
        struct.pack_into(fmt, data, offset, value)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    started = time.perf_counter()
    with pytest.raises(GgufFileError) as caught:
        load_model(damaged)
    seconds = time.perf_counter() - started
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert seconds <= 2.0, f"refused after {seconds:.2f} s (the issue's bound: 2 s from the header alone)"
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir()), "a damaged file was converted"


def test_the_cli_refuses_a_damaged_file_in_one_line(real_bytes, real_positions, tmp_path):
    data = bytearray(real_bytes)
    struct.pack_into("<I", data, real_positions["block_count"], 0)
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, "-m", "tierspec.cli", "generate", "--target", str(damaged), "Hello"],
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "TIERSPEC_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines == [f"tierspec: error: {damaged}: metadata 'llama.block_count': 0, but the file holds the tensors of "
                     "30 blocks (blk.0 to blk.29); expected the number of blocks whose tensors the file holds (30, "
                     "with every block from blk.0)"]
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_read_header_alone_skips_the_architecture(sound, tmp_path):
    """``read_header`` checks structure and layout only: a block count that does not fit passes it."""
    damaged = patched(sound, tmp_path / "d.gguf", (value_at(sound, "llama.block_count"), "<I", 0))
    assert read_header(damaged).fields["llama.block_count"] == 0
