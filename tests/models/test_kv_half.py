"""The engine's float16 KV caches (``Numerics.kv_dtype``, ``--dtype auto``'s; engine.h
``half_from_float``): the bits stored on every kernel path against numpy's rounding, and passes over
float16 caches against the same passes over float32 ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gguf_models import write_tiny_gguf
from test_engine_kernels import PATHS, kernels, qe
from tierspec import engine
from tierspec.cached_model import CachedModel
from tierspec.gguf_llama import load_gguf_llama
from tierspec.quant import numerics_for

PROMPT = (torch.arange(75) * 37 + 5) % 256


def stored_bits(x: np.ndarray) -> np.ndarray:
    """What the caches store, from numpy's float16 conversion (round to nearest even): the value
    clamped to +-65504 first, a subnormal result made a signed zero."""
    bits = np.clip(x, -65504.0, 65504.0).astype(np.float16).view(np.uint16).copy()
    tiny = (bits & 0x7C00) == 0
    bits[tiny] &= 0x8000
    return bits


def planted_values() -> np.ndarray:
    edges = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, -65520.0, 1e6, -1e30, np.inf, -np.inf,
                      2.0 ** -14, -(2.0 ** -14), 2.0 ** -14 * (1 - 2.0 ** -11), 2.0 ** -14 * (1 - 2.0 ** -12),
                      2.0 ** -15, 2.0 ** -24, -(2.0 ** -25), 1e-40, -1e-42, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11,
                      2049.0, 2051.0, 0.1, -3.14159], dtype=np.float32)
    rng = np.random.default_rng(3)
    scaled = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-9, 6, 20000)).astype(np.float32)
    patterns = rng.integers(0, 2 ** 32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([edges, scaled, patterns[np.isfinite(patterns)]])


def store(x: np.ndarray) -> np.ndarray:
    source = torch.from_numpy(np.ascontiguousarray(x))
    out = torch.empty(len(x), dtype=torch.int16)
    qe.store_half(x=source.data_ptr(), out=out.data_ptr(), count=len(x))
    return out.numpy().view(np.uint16)


@pytest.mark.parametrize("path", PATHS)
def test_every_path_stores_numpys_rounding_clamped_and_without_subnormals(path):
    values = planted_values()
    with kernels(path):
        assert engine.probe()["paths"]["store_half"] == ("portable" if path == "portable" else "avx2")
        got = store(values)
        odd = store(values[:13])  # fewer than a vector's lanes: the tail
    assert np.array_equal(got, stored_bits(values))
    assert np.array_equal(odd, stored_bits(values[:13]))
    nan = store(np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.all((nan & 0x7C00) == 0x7C00) and np.all(nan & 0x03FF)  # a NaN stays a NaN


def _model(folder, head_dim: int, layers: int = 2):
    tiny = write_tiny_gguf(folder, seed=5, layers=layers, hidden=2 * head_dim, heads=2, kv_heads=1)
    return load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))


def _caches(model, dtype: torch.dtype) -> None:
    for layer in model.model.layers:
        layer.fused.kv_dtype = dtype


# D = 16 takes the reference's attention on every path; 64 and 96 the vector kernels' (two compiled
# widths; tests/models/test_engine_kernels.py covers the widths read at run time on float32 caches).
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_a_half_cache_holds_the_float32_entries_rounded_and_passes_stay_close(tmp_path, path, head_dim):
    """The first layer's entries (computed from the embeddings alone, the same either way) are the
    float32 cache's rounded bit for bit; the logits stay within float16's rounding of a float32
    cache's, with the same greedy tokens; a token alone gives what it gives inside a long pass (the
    row contract on float16 caches); and the vector path reads what the reference path reads."""
    model = _model(tmp_path, head_dim)
    with torch.inference_mode(), kernels(path):
        _caches(model, torch.float32)
        wide = CachedModel(model)
        wide_logits = wide.forward(PROMPT).logits
        _caches(model, torch.float16)
        half = CachedModel(model)
        half_logits = half.forward(PROMPT).logits
        half.rollback(60)
        alone = torch.cat([half.forward(PROMPT[i : i + 1]).logits for i in range(60, 75)])
    first_wide, first_half = wide.cache.layers[0], half.cache.layers[0]
    assert first_half._keys.dtype == torch.float16 and first_wide._keys.dtype == torch.float32
    for wide_part, half_part in ((first_wide._keys, first_half._keys), (first_wide._values, first_half._values)):
        expected = stored_bits(wide_part[..., :75, :].contiguous().numpy().reshape(-1))
        assert np.array_equal(half_part[..., :75, :].contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1), expected)
    assert (half_logits - wide_logits).abs().max() <= 5e-3 * wide_logits.abs().max()
    assert torch.equal(half_logits.argmax(-1), wide_logits.argmax(-1))
    assert torch.equal(alone, half_logits[60:])
    if path != "portable":
        with torch.inference_mode(), kernels("portable"):
            reference = CachedModel(model).forward(PROMPT).logits
        # the paths' sums differ in their last bits (1e-5 of the scale on float32 caches); an entry of a
        # later layer that sits at a float16 rounding boundary may then round the other way, a
        # difference of half a float16 step (5e-4 of it): the bound is wider than float32 caches' by that
        assert (half_logits - reference).abs().max() <= 1e-4 * reference.abs().max()
        assert torch.equal(half_logits.argmax(-1), reference.argmax(-1))


def test_auto_numerics_make_half_caches_and_round_once(tmp_path):
    """``--dtype auto``'s numerics (``default_numerics``) make float16 caches, a dtype asked for by
    name float32 ones; the engine's table says 2-byte elements, and a rollback and a second pass over
    the same tokens give the same logits (entries rounded once, when written)."""
    from dataclasses import replace

    from tierspec.quant import default_numerics, kernel_key
    assert default_numerics().kv_dtype == torch.float16
    assert all(numerics_for(dtype).kv_dtype == torch.float32 for dtype in (torch.float32, torch.int8))
    half_numerics = replace(numerics_for(torch.float32), kv_dtype=torch.float16)
    assert kernel_key(half_numerics) != kernel_key(numerics_for(torch.float32))  # cost tables apart
    tiny = write_tiny_gguf(tmp_path, seed=7, layers=2, hidden=128, heads=2, kv_heads=1)
    model = load_gguf_llama(tiny.gguf, tiny.folder, half_numerics)
    fused = model.model.layers[0].fused
    assert fused.kv_dtype == torch.float16
    with torch.inference_mode():
        runner = CachedModel(model)
        first = runner.forward(PROMPT[:40]).logits
        table = runner.cache.engine_table(41, fused.kv_heads, fused.head_dim)
        assert table.shape[1] == 4 and bool((table[:, 3] == 2).all())
        assert runner.cache.layers[1]._keys.dtype == torch.float16
        runner.rollback(20)
        again = runner.forward(PROMPT[20:40]).logits
    assert torch.equal(again, first[20:])


def test_a_cache_of_another_type_is_refused(tmp_path):
    """The engine's layers make float16 or float32 caches, nothing else."""
    from tierspec.gguf_llama import FusedLayer
    model = _model(tmp_path, 64)
    layer = model.model.layers[0]
    with pytest.raises(ValueError, match="float16 or float32, not torch.bfloat16"):
        FusedLayer(layer, model.config, kv_dtype=torch.bfloat16)


def test_a_whole_layer_bypassed_by_a_mask_keeps_the_pass_on_the_engine(tmp_path):
    """A routing mask that bypasses a whole engine layer (CLaSP's and the self-drafter's masks) keeps
    the layer in place with both units bypassed, so the pass stays one engine call over the float16
    caches (a pass-through stand-in sent it to torch's float32 attention, which cannot read them), and
    it computes what the layer's removal computes: the other layers' entries, none of its own."""
    from tierspec.layerskip.masks import RoutingMask, apply_mask
    model = _model(tmp_path, 64, layers=3)
    _caches(model, torch.float16)
    mask = RoutingMask(3, unit="sublayer", skip_attention={1}, skip_mlp={1})
    with torch.inference_mode():
        with apply_mask(model, mask):
            assert model.model.fused
        runner = CachedModel(model)
        runner.forward(PROMPT[:30])
        masked = runner.forward(PROMPT[30:34], mask=mask).logits
        assert [layer.length for layer in runner.cache.layers] == [34, 30, 34]
    assert torch.isfinite(masked).all()
