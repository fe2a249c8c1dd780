"""benchmarks/scale.py's random-weight files: llama.cpp's Q4_K_M layout (more bits in the right
layers, fallbacks where rows are not super-blocks), valid blocks of every type it writes, and a
written file that tierspec reads as the architecture it claims."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale  # noqa: E402


def test_the_q4_k_m_layout_follows_llama_cpps_rules():
    layout = {name: kind for name, _, kind in scale.tensor_layout(scale.SHAPES["llama-3.1-8b"], "Q4_K_M")}
    more = [i for i in range(32) if layout[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]  # first/last eighth, every third between
    assert [i for i in range(32) if layout[f"blk.{i}.attn_v.weight"] == "Q6_K"] == more
    assert layout["output.weight"] == "Q6_K" and layout["token_embd.weight"] == "Q4_K"
    assert Counter(layout.values())["Q4_K"] == 32 * 7 - 2 * len(more) + 1
    # Qwen2.5-0.5B: 896-wide rows are not whole super-blocks (Q4_K → Q5_0, Q6_K → Q8_0); ffn_down's 4864 are
    qwen = {name: kind for name, _, kind in scale.tensor_layout(scale.SHAPES["qwen2.5-0.5b"], "Q4_K_M")}
    assert qwen["blk.5.attn_q.weight"] == "Q5_0" and qwen["blk.0.attn_v.weight"] == "Q8_0"
    assert qwen["blk.0.ffn_down.weight"] == "Q6_K" and qwen["blk.4.ffn_down.weight"] == "Q4_K"
    assert qwen["token_embd.weight"] == "Q8_0"  # tied: the head's Q6_K, fallen back
    assert all(kind in ("Q8_0", "F32") for _, _, kind in scale.tensor_layout(scale.SHAPES["qwen2.5-0.5b"], "Q8_0"))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K", "Q6_K"])
def test_random_blocks_are_valid_with_weights_near_one_over_sqrt_k(kind):
    pool = np.random.default_rng(0).integers(0, 256, size=(1 << 16) + 7, dtype=np.uint8)
    blocks = scale.random_blocks(kind, 8, 1024, pool)
    values = dequantize(blocks, GGMLQuantizationType[kind]).reshape(8, 1024)
    assert np.isfinite(values).all()
    assert 0.1 / 32 < float(np.abs(values).mean()) < 4 / 32  # 1/sqrt(1024) = 1/32


def test_a_written_file_reads_as_its_architecture(tmp_path, monkeypatch):
    from tierspec.architectures import read_architecture
    from tierspec.quant import read_gguf_tensors

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    monkeypatch.setitem(scale.SHAPES, "tiny-qwen", scale.Shape("qwen2", 256, 2, 4, 2, 512, 300, True, 1e6))
    path = scale.write_file("tiny-qwen", "Q4_K_M")
    assert path == tmp_path / "scale" / f"tiny-qwen-Q4_K_M-v{scale.WRITER_VERSION}.gguf"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no partial file left
    tensors, fields = read_gguf_tensors(path)
    arch = read_architecture(fields, tensors)
    assert (arch.name, arch.num_layers, arch.hidden_size, arch.vocab_size, arch.qkv_bias) == ("qwen2", 2, 256, 300, True)
    assert scale.write_file("tiny-qwen", "Q4_K_M").stat().st_mtime_ns == path.stat().st_mtime_ns  # written once


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_qwen3_and_phi3_files_read_as_their_architecture(tmp_path, monkeypatch, arch):
    """Qwen3: heads wider than hidden / heads and q/k norms; Phi-3: one q/k/v and one gate/up tensor."""
    from tierspec.architectures import read_architecture
    from tierspec.quant import read_gguf_tensors

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    shape = {"qwen3": scale.Shape("qwen3", 256, 2, 4, 2, 512, 300, True, 1e6, head_dim=128),
             "phi3": scale.Shape("phi3", 256, 2, 4, 4, 512, 300, False, 1e4)}[arch]
    monkeypatch.setitem(scale.SHAPES, f"tiny-{arch}", shape)
    tensors, fields = read_gguf_tensors(scale.write_file(f"tiny-{arch}", "Q4_K_M"))
    found = read_architecture(fields, tensors)
    assert (found.name, found.num_layers, found.hidden_size, found.vocab_size) == (arch, 2, 256, 300)
    assert found.engine_gaps() == []
    if arch == "qwen3":
        assert found.features == ["qk_norm"] and found.head_dim == 128
        assert tuple(tensors["blk.0.attn_q.weight"].shape) == (4 * 128, 256)
    else:
        assert found.fused_qkv and found.fused_gate_up and not found.tied_embeddings
        assert tuple(tensors["blk.0.attn_qkv.weight"].shape) == (3 * 256, 256)
        assert tuple(tensors["blk.1.ffn_up.weight"].shape) == (2 * 512, 256)


def test_llama_cpp_loads_a_file_named_phi_3(tmp_path, monkeypatch):
    """llama.cpp looks Phi-3's "<|endoftext|>" up by its text in any file whose name says Phi-3, and
    refused scale.py's Phi-3-mini file without it ("error loading model vocabulary")."""
    llama_cpp = pytest.importorskip("llama_cpp")
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    monkeypatch.setitem(scale.SHAPES, "phi-3-tiny", scale.Shape("phi3", 384, 2, 4, 4, 512, 32064, False, 1e4))
    path = scale.write_file("phi-3-tiny", "Q8_0")
    llama = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, verbose=False)
    try:
        assert llama.n_vocab() == 32064
        assert llama.detokenize([32000], special=True) == b"<|endoftext|>"
    finally:
        llama.close()
