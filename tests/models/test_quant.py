"""The pass engine (tierspec/csrc through tierspec.quant and tierspec.gguf_llama): the
file's weights exactly, products against a float64 reference, row independence bitwise, the
portable loop equal to the AVX2 kernel bitwise, the fused layer against torch's operators, token
trees equal to chains, routing masks, rollback and bad files."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from arch_models import K_TYPES, k_blocks
from gguf_models import write_tiny_gguf
from tierspec import engine, quant
from tierspec.cached_model import CachedModel, HiddenCapture
from tierspec.errors import ModelLoadError
from tierspec.gguf_llama import load_gguf_llama
from tierspec.quant import QuantWeight, numerics_for
from tierspec.sampling import first_maxima

qe = engine.engine()
NATIVE_AVX512 = engine.probe()["paths"]["bfloat16"] != "portable"
HAS_AVX2 = "avx2" in qe.isas()


@contextlib.contextmanager
def portable_loops():
    before = qe.isa()
    qe.select_isa("portable")
    try:
        yield
    finally:
        qe.select_isa(before)


HAS_VNNI = "avx512vnni" in qe.isas()


def _numerics(name: str) -> quant.Numerics:
    if name == "int8":
        return numerics_for(torch.int8)
    if name == "bfloat16-native":
        if not NATIVE_AVX512:
            pytest.skip("this CPU has no AVX512-BF16")
        return numerics_for(torch.bfloat16)
    if name == "bfloat16-emulated":
        return quant.Numerics(torch.bfloat16, quant.LAYOUT_FLOAT32_FMA, True)
    return numerics_for(torch.float32)


NUMERICS = ["float32", "bfloat16-emulated", "bfloat16-native", "int8"]
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def _width(kind: str, width: int) -> int:
    """``width`` for a 32-value type; for a K-quant the multiple of 256 at or above it (two super-blocks
    at least, so a tile's cells follow one another)."""
    return max(512, -(-width // 256) * 256) if kind in K_TYPES else width


def _blocks(kind: str, rows: int, width: int, seed: int = 0, extremes: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows quantised by gguf-py (K-quants, which it cannot quantise: random valid blocks with
    planted extreme scales, ``arch_models.k_blocks``), and gguf-py's own de-quantisation of them."""
    if kind in K_TYPES:
        data = k_blocks(kind, rows, width, seed, extremes)
    else:
        rng = np.random.default_rng(seed)
        values = rng.standard_normal((rows, width)).astype(np.float32)
        values[0, :32] = 0.0  # an all-zero block (scale 0)
        data = quantize(values, GGMLQuantizationType[kind])
    return torch.from_numpy(data.copy()), torch.from_numpy(dequantize(data, GGMLQuantizationType[kind]).copy())


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", TYPES)
def test_the_weights_are_the_files_values_bitwise(kind, numerics):
    width = _width(kind, 96)
    raw, reference = _blocks(kind, 50, width)  # 50 rows: four tiles, the last one partly padding
    assert torch.isfinite(reference).all()
    weight = QuantWeight(raw, getattr(quant, kind), width, _numerics(numerics))
    assert torch.equal(weight.dense(), reference)
    assert torch.equal(weight.rows(torch.tensor([49, 0, 17, 17])), reference[[49, 0, 17, 17]])
    # ids of another dtype and shape, or a strided view, read as the same rows
    assert torch.equal(weight.rows(torch.tensor([[3, 4]], dtype=torch.int32)), reference[[3, 4]])
    assert torch.equal(weight.rows(torch.tensor([9, 0, 8, 0])[::2]), reference[[9, 8]])
    for bad in ([50], [0, -1], [2, 3, 10**12]):  # the engine checks every id before it reads a row
        with pytest.raises(IndexError):
            weight.rows(torch.tensor(bad))


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows as the int8 numerics use them: each block of 32 rounded to 8 bits with scale max|x| / 127."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
    return (q * scale).reshape(x.shape)


def _reference_product(x: torch.Tensor, weight: torch.Tensor, numerics: quant.Numerics) -> torch.Tensor:
    if numerics.dtype == torch.int8:
        rows = _int8_rows(x)
    else:
        rows = x.to(torch.bfloat16).float() if numerics.dtype == torch.bfloat16 else x
    return (rows.double() @ weight.double().t()).float()


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", TYPES)
def test_products_match_a_float64_reference_and_rows_are_independent(kind, numerics):
    width = _width(kind, 160)
    raw, dense = _blocks(kind, 40, width, seed=1, extremes=False)
    setting = _numerics(numerics)
    weight = QuantWeight(raw, getattr(quant, kind), width, setting)
    torch.manual_seed(0)
    x = torch.randn(21, width)
    out = weight.multiply(x)
    expected = _reference_product(x, dense, setting)
    # float32 sums of 160 (512) products: a few ulps of the largest terms
    assert (out - expected).abs().max() <= 1e-5 * expected.abs().max() * 10 * width / 160
    for start, stop in ((0, 1), (5, 6), (3, 7), (0, 16), (4, 21), (20, 21)):
        assert torch.equal(weight.multiply(x[start:stop].contiguous()), out[start:stop]), (start, stop)
    accumulated = torch.ones(21, 40)
    weight.multiply(x, accumulated, accumulate=True)
    assert torch.equal(accumulated, 1 + out)


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("kind", TYPES)
def test_selected_rows_are_a_weight_of_their_own(kind, numerics):
    """``select`` (a draft vocabulary's rows of the LM head, a Q4_K_M file's Q6_K): the same values,
    and products bitwise the full weight's columns."""
    width = _width(kind, 96)
    raw, reference = _blocks(kind, 50, width, seed=6)
    weight = QuantWeight(raw, getattr(quant, kind), width, _numerics(numerics))
    chosen = torch.tensor([49, 0, 17, 33, 16, 2])
    selected = weight.select(chosen)
    assert torch.equal(selected.dense(), reference[chosen])
    x = torch.randn(5, width)
    assert torch.equal(selected.multiply(x), weight.multiply(x)[:, chosen])


def test_rows_rounded_to_bfloat16_differ_from_float32_rows():
    # a planted row whose bfloat16 rounding matters: the numerics are not silently float32
    raw, dense = _blocks("Q4_1", 16, 32, seed=2)
    x = torch.full((1, 32), 1.0 + 2 ** -10)
    f32 = QuantWeight(raw, quant.Q4_1, 32, _numerics("float32")).multiply(x)
    emulated = QuantWeight(raw, quant.Q4_1, 32, _numerics("bfloat16-emulated")).multiply(x)
    # sums of 32 terms of magnitude ~1 in float32: ~1e-6 absolute
    assert torch.allclose(f32, _reference_product(x, dense, _numerics("float32")), rtol=0, atol=2e-5)
    assert torch.allclose(emulated, (torch.ones(1, 32).double() @ dense.double().t()).float(), rtol=0, atol=2e-5)
    assert not torch.equal(f32, emulated)


@pytest.mark.skipif(not HAS_VNNI, reason="no AVX512-VNNI on this CPU")
@pytest.mark.parametrize("kind", TYPES)
def test_the_portable_loop_equals_the_vnni_kernel_bitwise(kind):
    # integer dot products are exact, and both take the same float steps after them
    width = _width(kind, 128)
    raw, _ = _blocks(kind, 48, width, seed=3)
    weight = QuantWeight(raw, getattr(quant, kind), width, _numerics("int8"))
    x = torch.randn(11, width) * 3
    vector = weight.multiply(x)
    with portable_loops():
        portable = weight.multiply(x)
    assert torch.equal(vector, portable)


@pytest.mark.skipif(not HAS_AVX2, reason="no AVX2 on this CPU")
@pytest.mark.parametrize("kind", TYPES)
def test_the_portable_loop_equals_the_avx2_kernel_bitwise(kind):
    width = _width(kind, 128)
    raw, _ = _blocks(kind, 48, width, seed=3)
    weight = QuantWeight(raw, getattr(quant, kind), width, _numerics("float32"))
    x = torch.randn(9, width)
    vector = weight.multiply(x)
    with portable_loops():
        assert qe.isa() == "portable"
        portable = weight.multiply(x)
    assert torch.equal(vector, portable)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_results_do_not_depend_on_the_thread_count(kind):
    raw, _ = _blocks(kind, 4096, 256, seed=4)  # large enough to be split across threads
    weight = QuantWeight(raw, getattr(quant, kind), 256, numerics_for(torch.bfloat16))
    x = torch.randn(7, 256)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(weight.multiply(x))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("numerics", NUMERICS)
def test_a_weight_stacked_from_parts_of_different_types_is_each_parts_product(numerics):
    """A Q4_K_M layer's fused projection: q/k Q4_K, v Q6_K (and a Q8_0 part, as Q5_0's copies are),
    one engine weight whose rows are the parts' in order, each part's product bitwise what the part
    alone gives (the rows are prepared once, each part multiplied by its own kind's kernel)."""
    setting = _numerics(numerics)
    parts = [("Q4_K", 48, 1), ("Q6_K", 20, 2), ("Q8_0", 16, 3), ("Q4_K", 8, 4)]
    blocks = [(kind, *_blocks(kind, rows, 512, seed=seed)) for kind, rows, seed in parts]
    order = torch.arange(20).flip(0)  # a part's rows taken in another order (as q/k's permutation)
    stacked = QuantWeight(None, quant.Q4_K, 512, setting, parts=[
        (raw, order if kind == "Q6_K" else None, getattr(quant, kind)) for kind, raw, _ in blocks])
    assert stacked.type_name == "Q4_K+Q6_K+Q8_0+Q4_K" and stacked.out_features == 92
    alone = [QuantWeight(raw, getattr(quant, kind), 512, setting) for kind, raw, _ in blocks]
    dense = torch.cat([dense if kind != "Q6_K" else dense[order] for kind, _, dense in blocks])
    assert torch.equal(stacked.dense(), dense)
    assert stacked.nbytes == sum(part.nbytes for part in alone)
    x = torch.randn(19, 512)
    expected = torch.cat([part.multiply(x) if kind != "Q6_K" else part.multiply(x)[:, order]
                          for part, (kind, _, _) in zip(alone, blocks)], dim=1)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            assert torch.equal(stacked.multiply(x), expected), count
            product, maxima = stacked.multiply_with_maxima(x)  # the parts' columns in order
            assert torch.equal(product, expected) and maxima == first_maxima(expected), count
            assert torch.equal(stacked.multiply(x[4:5].contiguous()), expected[4:5])
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="not a stacked"):
        stacked.select(torch.tensor([0]))


def test_bad_blocks_are_refused():
    raw, _ = _blocks("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="take 40 bytes"):
        QuantWeight(raw[:, :-1], quant.Q4_1, 64, numerics_for(torch.float32))
    with pytest.raises(ValueError, match="not computed natively"):
        QuantWeight(raw, 6, 64, numerics_for(torch.float32))  # Q5_0 (the loader re-encodes it as Q8_0)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        QuantWeight(raw, quant.Q4_K, 64, numerics_for(torch.float32))
    k_raw, _ = _blocks("Q4_K", 16, 256)
    alternating = [(k_raw, None, quant.Q4_K), (raw[:, :20], None, quant.Q4_1)] * 3  # 6 runs of one type
    with pytest.raises(ValueError, match="at most 4 runs of one type, not 6"):
        QuantWeight(None, quant.Q4_K, 256, numerics_for(torch.float32), parts=alternating)
    with pytest.raises(ValueError, match="Q4_1 rows of 256 values take 160 bytes each"):
        QuantWeight(None, quant.Q4_K, 256, numerics_for(torch.float32), parts=alternating[:2])
    wide = QuantWeight(k_raw, quant.Q4_K, 256, numerics_for(torch.float32))
    narrow = QuantWeight(raw, quant.Q4_1, 64, numerics_for(torch.float32))
    with pytest.raises(ValueError, match="part 1's inputs \\(64, layout 1\\) differ from the first part's \\(256"):
        engine.engine().stack_weights((wide.handle, narrow.handle))
    with pytest.raises(ModelLoadError, match="bfloat16, float32 or int8"):
        numerics_for(torch.float16)


# ---- the fused model against torch's operators ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf"), seed=5)


def _model(tiny, numerics: str):
    return load_gguf_llama(tiny.gguf, tiny.folder, _numerics(numerics))


PROMPT = torch.tensor([3, 17, 99, 4, 250, 8, 8, 41, 77, 12, 5, 190])


@pytest.mark.parametrize("numerics", ["float32", "bfloat16-native", "int8"])
def test_the_fused_model_matches_torchs_operators_on_the_same_weights(tiny, numerics):
    model, reference = _model(tiny, numerics), tiny.reference()
    assert model.model.fused
    with torch.inference_mode():
        ours, theirs = CachedModel(model), CachedModel(reference)
        logits, expected = ours.forward(PROMPT).logits, theirs.forward(PROMPT).logits
        for token in (7, 200, 31):  # cached one-token passes
            step = torch.tensor([token])
            logits = torch.cat((logits, ours.forward(step).logits))
            expected = torch.cat((expected, theirs.forward(step).logits))
    scale = expected.abs().max()
    # bfloat16 rows: 2^-9 relative per input; int8 rows: 1/254 of each block's largest
    tolerance = {"float32": 2e-5, "bfloat16-native": 3e-2, "int8": 6e-2}[numerics]
    assert (logits - expected).abs().max() <= tolerance * scale
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("numerics", ["float32", "bfloat16-emulated", "bfloat16-native", "int8"])
def test_a_tokens_logits_do_not_depend_on_its_pass(tiny, numerics):
    model = _model(tiny, numerics)
    runner = CachedModel(model)
    with torch.inference_mode():
        whole = runner.forward(PROMPT).logits
        runner.rollback(0)
        pieces = torch.cat([runner.forward(PROMPT[i : i + 1]).logits for i in range(len(PROMPT))])
        runner.rollback(4)
        middle = runner.forward(PROMPT[4:9]).logits
    assert torch.equal(whole, pieces)
    assert torch.equal(middle, whole[4:9])


def test_a_tree_node_gets_its_chains_logits_bitwise(tiny):
    from tierspec.tree import TokenTree, tree_pass

    model = _model(tiny, "bfloat16-native" if NATIVE_AVX512 else "float32")
    runner = CachedModel(model)
    paths = [[11, 12, 13], [11, 40], [60, 61, 62, 63], [11, 12, 99]]
    tree = TokenTree.from_paths(paths)

    def node_row(prefix):  # the pass row of the node reached by ``prefix`` (after the one pending row)
        node = -1
        for token in prefix:
            node = next(i for i in range(len(tree)) if int(tree.parents[i]) == node and int(tree.tokens[i]) == token)
        return 1 + node

    with torch.inference_mode():
        runner.forward(PROMPT)
        layout = tree_pass(torch.tensor([5]), tree)
        tree_logits = runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits
        runner.rollback(len(PROMPT))
        for path in paths:
            chain = runner.forward(torch.tensor([5] + path)).logits
            runner.rollback(len(PROMPT))
            rows = [node_row(path[: depth + 1]) for depth in range(len(path))]
            assert torch.equal(tree_logits[rows], chain[1:])
            assert torch.equal(tree_logits[0], chain[0])


@pytest.mark.parametrize("units", [[("attn", 1)], [("mlp", 1)], [("layer", 1)]])
def test_a_bypassed_unit_is_skipped_as_on_torchs_operators(tiny, units):
    from tierspec.layerskip.masks import RoutingMask

    model, reference = _model(tiny, "float32"), tiny.reference()
    mask = RoutingMask.from_units(3, units[0][0] if units[0][0] == "layer" else "sublayer", units)
    with torch.inference_mode():
        ours = CachedModel(model).forward(PROMPT, mask=mask).logits
        theirs = CachedModel(reference).forward(PROMPT, mask=mask).logits
        full = CachedModel(model).forward(PROMPT).logits
    assert (ours - theirs).abs().max() <= 2e-5 * theirs.abs().max()
    assert (ours - full).abs().max() > 1e-3  # the mask changed something


def test_hidden_states_and_rollback(tiny):
    model, reference = _model(tiny, "float32"), tiny.reference()
    with torch.inference_mode():
        ours = CachedModel(model).forward(PROMPT, with_hidden=True, hidden_layers=(1,)).hidden
        theirs = CachedModel(reference).forward(PROMPT, with_hidden=True, hidden_layers=(1,)).hidden
        assert (ours - theirs).abs().max() <= 1e-4 * theirs.abs().max()
        runner = CachedModel(model)
        runner.forward(PROMPT)
        runner.rollback(5)
        assert runner.layer_lengths() == [5, 5, 5]
        again = runner.forward(PROMPT[5:]).logits
        assert torch.equal(again, CachedModel(model).forward(PROMPT).logits[5:])
        with pytest.raises(RuntimeError, match="rollback invariant"):
            runner.cache.layers[0].trim(2)
            runner.forward(PROMPT[:1])


def test_an_untied_head_and_a_q4_0_file(tmp_path):
    tiny = write_tiny_gguf(tmp_path, seed=6, layer_type="Q4_0", head_type="Q4_1", tied=False, vocab=250)
    model, reference = _model(tiny, "float32"), tiny.reference()
    with torch.inference_mode():
        ours, theirs = CachedModel(model).forward(PROMPT[PROMPT < 250]).logits, \
            CachedModel(reference).forward(PROMPT[PROMPT < 250]).logits
    assert ours.shape[-1] == 250
    assert (ours - theirs).abs().max() <= 2e-5 * theirs.abs().max()


def test_a_file_cut_short_is_a_clear_error(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.gguf.read_bytes()[: tiny.gguf.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="past the end of the file|cut short"):
        load_gguf_llama(cut, tiny.folder, numerics_for(torch.float32))
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_gguf_llama(tmp_path / "not.gguf", tiny.folder, numerics_for(torch.float32))


def test_a_batched_pass_gives_every_sequence_its_solo_pass_bitwise(tiny):
    """Sequences of different lengths, new-row counts and a token tree share one pass
    (``cached_model.batched_pass``): each gets exactly its own pass's logits and hidden states, and
    its cache advances as its own pass would."""
    from tierspec.cached_model import BatchItem, batched_pass
    from tierspec.tree import TokenTree, tree_pass

    model = _model(tiny, "bfloat16-native" if NATIVE_AVX512 else "float32")
    prompts = [PROMPT, PROMPT[:5], torch.tensor([9, 9, 9, 9, 9, 9, 9, 9, 9])]
    solo = [CachedModel(model) for _ in prompts]
    shared = [CachedModel(model) for _ in prompts]
    layout = tree_pass(torch.tensor([4]), TokenTree.from_paths([[5, 6], [5, 7], [8]]))
    with torch.inference_mode():
        expected = [runner.forward(p).logits for runner, p in zip(solo, prompts)]
        # a sequence's ids as a tensor or a list of ints (a chain's, as the cycle makes them)
        got = batched_pass(model, [BatchItem(runner, p.tolist() if i == 1 else p)
                                   for i, (runner, p) in enumerate(zip(shared, prompts))])
        assert all(torch.equal(g.logits, e) for g, e in zip(got, expected))
        steps = [BatchItem(shared[0], [3, 1, 4], logits_for=2),
                 BatchItem(shared[1], layout.tokens, offsets=layout.offsets, attends=layout.attends),
                 BatchItem(shared[2], torch.tensor([7]))]
        # the first layer, a middle one and the last, each copied out inside the one stack call
        layers = (0, 1, len(model.model.layers) - 1)
        expected = [solo[0].forward(torch.tensor([3, 1, 4]), logits_for=2, with_hidden=True, hidden_layers=layers),
                    solo[1].forward(layout.tokens, offsets=layout.offsets, attends=layout.attends, with_hidden=True,
                                    hidden_layers=layers),
                    solo[2].forward(torch.tensor([7]), with_hidden=True, hidden_layers=layers)]
        got = batched_pass(model, steps, hidden_layers=layers)
        assert len(model.model.layers) > 2 and got[2].hidden.shape[-1] == 4 * model.config.hidden_size
    for g, e in zip(got, expected):
        assert torch.equal(g.logits, e.logits) and torch.equal(g.hidden, e.hidden)
        assert g.first_maxima == first_maxima(g.logits)  # found in the LM head's product, each sequence's own rows
    assert [r.length for r in shared] == [r.length for r in solo]
    assert [r.layer_lengths() for r in shared] == [r.layer_lengths() for r in solo]
    with pytest.raises(ValueError, match="twice"):
        batched_pass(model, [BatchItem(shared[0], torch.tensor([1])), BatchItem(shared[0], torch.tensor([2]))])


def test_the_engine_cache_checks_advances_and_trims_every_layer_together(tiny):
    """A model on the engine keeps its layers' lengths in one list (``ViewOnReadKVLayer.for_cache``):
    a pass checks and advances them together, a routing mask's bypassed layers stay behind, a
    rollback trims them together, and each layer's own ``length`` reads and writes its entry — the
    same lengths a layer-by-layer cache (``KVLayer``) keeps through the same calls."""
    from tierspec.layerskip.masks import RoutingMask
    from tierspec.llama import KVCache, KVLayer

    model = _model(tiny, "float32")
    mask = RoutingMask.from_units(3, "sublayer", [("attn", 1)])
    runner = CachedModel(model)
    assert runner.cache._lengths is not None
    with torch.inference_mode():
        runner.forward(PROMPT[:6])
        assert runner.layer_lengths() == [6, 6, 6]
        runner.forward(PROMPT[6:8], mask=mask)  # layer 1's attention bypassed: it writes no KV
        assert [layer.length for layer in runner.cache.layers] == [8, 6, 8]
        assert runner.cache._written == [8, 6, 8]
        runner.rollback(7)
        assert [layer.length for layer in runner.cache.layers] == [7, 6, 7]
        with pytest.raises(RuntimeError, match="layer 1's cache holds 6 positions.*rollback invariant"):
            runner.forward(PROMPT[7:8])
        assert [layer.length for layer in runner.cache.layers] == [7, 6, 7]  # refused before anything ran
        runner.rollback(6)
        again = runner.forward(PROMPT[6:]).logits
        assert torch.equal(again, CachedModel(model).forward(PROMPT).logits[6:])
    # the same calls on layers that keep their own lengths
    own = KVCache(3, KVLayer)
    for layer in own.layers:
        layer.slots(16, 1, 4)  # buffers to view
    for layers in (own, runner.cache):
        layers.trim(0)
        layers.advance(5)
        layers.advance(2, [0, 2])
        assert [layer.length for layer in layers.layers] == [7, 5, 7]
        layers.check_start(5, [1])
        with pytest.raises(RuntimeError, match="layer 0's cache holds 7"):
            layers.check_start(5)
        layers.trim(6)
        assert [layer.length for layer in layers.layers] == [6, 5, 6]
        layers.layers[1].length = 6
        layers.check_start(6)


def test_a_written_slot_is_never_zeroed_after_the_cache_advanced_together(tiny):
    """``window`` zeroes slots never written (torch's attention reads whole key blocks): the
    extent written follows the lengths the engine advanced all at once, so the engine's entries
    survive a later torch window over them."""
    model = _model(tiny, "float32")
    runner = CachedModel(model)
    with torch.inference_mode():
        runner.forward(PROMPT)
        layer = runner.cache.layers[0]
        written = layer._keys[..., : len(PROMPT), :].clone()
        assert layer._finite == len(PROMPT)
        keys, _ = layer.window(len(PROMPT) + 3)
        assert torch.equal(keys[..., : len(PROMPT), :], written)
        assert not keys[..., len(PROMPT) :, :].any()


def test_an_engine_table_names_the_buffers_a_pass_writes(tiny):
    """The table of a cache's buffers is made again after any of them was reallocated, and only then
    (an allocation elsewhere leaves it as it was): a pass past the reserved slots writes the new
    buffers, and its logits are those of a cache reserved large enough from the start."""
    from tierspec.llama import KEY_BLOCK

    model = _model(tiny, "float32")
    first = model.model.layers[0].fused
    grown, large = CachedModel(model), CachedModel(model)
    large.reserve(KEY_BLOCK + 8)
    tokens = PROMPT.repeat(KEY_BLOCK // len(PROMPT) + 2)[: KEY_BLOCK + 8]
    with torch.inference_mode():
        grown.forward(tokens[:KEY_BLOCK - 2])
        table = grown.cache.engine_table(KEY_BLOCK - 2, first.kv_heads, first.head_dim, first.kv_dtype)
        CachedModel(model).forward(PROMPT)  # another cache allocates its buffers
        assert grown.cache.engine_table(KEY_BLOCK - 2, first.kv_heads, first.head_dim, first.kv_dtype) is table
        logits = grown.forward(tokens[KEY_BLOCK - 2 :]).logits  # past the block: the buffers grow
        moved = grown.cache.engine_table(KEY_BLOCK + 8, first.kv_heads, first.head_dim, first.kv_dtype)
        assert moved is not table and int(moved[0, 0]) == grown.cache.layers[0]._keys.data_ptr()
        expected = large.forward(tokens).logits[KEY_BLOCK - 2 :]
        grown.reserve(4 * KEY_BLOCK)  # reallocated, the old table's capacity still enough for the next pass
        again = grown.cache.engine_table(KEY_BLOCK + 9, first.kv_heads, first.head_dim, first.kv_dtype)
        assert int(again[0, 0]) == grown.cache.layers[0]._keys.data_ptr() != int(moved[0, 0])
        assert torch.equal(grown.forward(PROMPT[:1]).logits, large.forward(PROMPT[:1]).logits)
    assert torch.equal(logits, expected)


def test_a_batched_pass_reads_embeddings_and_scores_rows_as_the_modules_do(tiny):
    """``quant.embedded_rows`` / ``cached_model._scored``: the quantised table's rows and head's product called
    directly are the modules' bitwise, for rows of any layout (strided or bfloat16 rows go through
    the module, which converts them); the direct product's rows' first maxima are ``first_maxima``'s and
    its keyed rows' draws ``keyed_tokens``', the module's come without either."""
    from tierspec.cached_model import _scored
    from tierspec.quant import embedded_rows
    from tierspec.sampling import NOT_DRAWN, first_maxima, keyed_tokens

    model = _model(tiny, "float32")
    embedding, head = model.model.embed_tokens, model.lm_head
    ids = torch.tensor([5, 0, 17, 5])
    assert torch.equal(embedded_rows(embedding, ids), embedding(ids).float())
    rows = torch.randn(6, model.config.hidden_size)
    logits, maxima, draws = _scored(head, rows)
    assert torch.equal(logits, head(rows).float()) and maxima == first_maxima(logits) and draws is None
    keys = [11, None, 2**64 - 1, 5, None, 8]
    logits, maxima, draws = _scored(head, rows, keys, [1.0, 1.0, 0.5, 1.0, 1.0, 2.0])
    assert torch.equal(logits, head(rows).float()) and maxima == first_maxima(logits)
    assert draws == [keyed_tokens(logits[0:1], [11])[0], NOT_DRAWN, keyed_tokens(logits[2:3] / 0.5, [2**64 - 1])[0],
                     keyed_tokens(logits[3:4], [5])[0], NOT_DRAWN, keyed_tokens(logits[5:6] / 2.0, [8])[0]]
    strided = torch.randn(model.config.hidden_size, 6).t()  # not contiguous
    assert torch.equal(_scored(head, strided, keys, [1.0] * 6)[0], head(strided.contiguous()).float())
    assert _scored(head, strided, keys, [1.0] * 6)[1:] == (None, None)
    assert torch.equal(_scored(head, rows.bfloat16())[0], head(rows.bfloat16().float()).float())


def test_a_layers_engine_table_is_kept_while_its_row_is_and_remade_when_the_buffers_move():
    """``KVLayer.engine_table`` (a one-layer table, the draft head's): the same tensor while the
    buffers stay, a new one naming the new buffers once a write past the capacity reallocated them,
    on a layer that makes its views when read too."""
    from tierspec.llama import KEY_BLOCK, KVLayer, ViewOnReadKVLayer

    for layer in (KVLayer(), ViewOnReadKVLayer()):
        table = layer.engine_table(4, 2, 32, torch.float16)
        assert tuple(table.shape) == (1, 4) and table.dtype == torch.int64
        assert table.tolist()[0] == [layer._keys.data_ptr(), layer._values.data_ptr(), KEY_BLOCK, 2]
        assert layer.engine_table(KEY_BLOCK, 2, 32, torch.float16) is table  # within the capacity: kept
        moved = layer.engine_table(KEY_BLOCK + 1, 2, 32, torch.float16)  # past it: reallocated
        assert moved is not table and moved.tolist()[0] == [layer._keys.data_ptr(), layer._values.data_ptr(),
                                                            2 * KEY_BLOCK, 2]


def test_a_lone_request_runs_as_one_stack_unless_a_module_is_hooked(tiny, monkeypatch):
    """The engine's backend runs a lone request as a batched pass of one (``passes.EnginePasses``):
    the same logits and features as its cache's own pass; where a layer carries a forward hook,
    which only a module call runs, each request as its cache's own pass — one or several — and the
    hook sees every pass."""
    from tierspec import cached_model, passes
    from tierspec.passes import PassRequest

    model = _model(tiny, "float32")
    backend = passes.pass_backend(model)
    ran = []
    batched = cached_model.batched_pass
    monkeypatch.setattr(passes, "batched_pass", lambda *args, **kwargs: ran.append("batched") or batched(*args, **kwargs))
    solo, lone = CachedModel(model), CachedModel(model)
    with torch.inference_mode():
        expected = solo.forward(PROMPT, with_hidden=True, hidden_layers=(1, 0))
        (got,) = backend.run([PassRequest(lone, PROMPT, None, hidden_layers=(1, 0))])
        assert ran == ["batched"] and torch.equal(got.logits, expected.logits) and torch.equal(got.hidden, expected.hidden)
        seen = []
        hook = model.model.layers[1].register_forward_hook(lambda module, args, output: seen.append(output.shape[1]))
        other, other_solo = CachedModel(model), CachedModel(model)
        try:
            (again,) = backend.run([PassRequest(lone, PROMPT[:3], None)])
            both = backend.run([PassRequest(lone, PROMPT[3:5], None), PassRequest(other, PROMPT[:4], None)])
        finally:
            hook.remove()
        assert ran == ["batched"] and seen == [3, 2, 4]
        assert torch.equal(again.logits, solo.forward(PROMPT[:3]).logits)
        assert torch.equal(both[0].logits, solo.forward(PROMPT[3:5]).logits)
        assert torch.equal(both[1].logits, other_solo.forward(PROMPT[:4]).logits)
        lone.rollback(3)
        solo.rollback(3)
        (last,) = backend.run([PassRequest(lone, PROMPT[3:4], None)])  # the hook gone: one stack again
        assert ran == ["batched", "batched"] and torch.equal(last.logits, solo.forward(PROMPT[3:4]).logits)


def test_a_forked_child_computes_with_an_empty_pool():
    import os

    raw, _ = _blocks("Q4_1", 4096, 256, seed=7)  # split across threads in the parent
    weight = QuantWeight(raw, quant.Q4_1, 256, numerics_for(torch.float32))
    x = torch.randn(6, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = weight.multiply(x)
        pid = os.fork()
        if pid == 0:  # the parent's worker threads do not exist here
            os._exit(0 if torch.equal(weight.multiply(x), expected) else 3)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        torch.set_num_threads(threads)


def test_torch_runs_on_one_thread_inside_a_generation_and_gets_its_threads_back():
    """Torch's operators on one thread, the engine and the sampled tokens of many rows
    (``sampling.share_rows_among``) on the caller's; everything back on leaving."""
    from tierspec import sampling

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with engine.torch_ops_on_one_thread():
            assert torch.get_num_threads() == 1 and engine.engine_threads() == 2 and sampling._row_threads == 2
            with engine.torch_ops_on_one_thread():  # nested (a stream inside a stream's step): still the caller's
                assert engine.engine_threads() == 2 and sampling._row_threads == 2
        assert torch.get_num_threads() == 2 and engine.engine_threads() == 2 and sampling._row_threads == 1
    finally:
        torch.set_num_threads(threads)
