"""The engine's kernel paths (tierspec/csrc, docs/engine.md): every vector and tile kernel this CPU
runs against the plain-C reference (bitwise for float32 and int8 rows, a stated tolerance for
bfloat16 dot products), the AMX kernels over emulated tiles here and over real ones on an AMX
machine, the row contract on every path (a token's logits alone = inside passes of 2-64 rows, tree
nodes = chains, 1/2/3 threads), chunked prefill = unchunked, the strict ISA cap and the probe; and
the layer features of the other architectures (tests/arch_models.py's files: biases, q/k norms,
Gemma's post-norms and GELU-tanh gate, sliding windows, two rotary tables, partial rotary, heads of
256, a planted attention scale and soft-cap) under the same contract on every path."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from arch_models import K_TYPES, WINDOW, k_blocks, write_arch_gguf
from gguf_models import write_tiny_gguf
from tierspec import engine, gguf_model, quant
from tierspec.architectures import read_architecture
from tierspec.cached_model import CachedModel
from tierspec.gguf_llama import load_gguf_llama
from tierspec.gguf_check import ggml_type_sizes
from tierspec.quant import QuantWeight, numerics_for, read_gguf_tensors

qe = engine.engine()
PATHS = qe.isas()  # the paths this process may select, portable first
VECTOR_PATHS = [path for path in PATHS if path != "portable"]
HAS_AVX512 = "avx512" in PATHS
NATIVE_BF16 = "avx512bf16" in PATHS
AMX_REASON = engine.probe()["amx_reason"] or "AMX is in use"


@contextlib.contextmanager
def kernels(path: str):
    """The kernels of ``path`` ("amx-emulated": the AMX kernels over emulated tiles) within the block."""
    before = qe.isa()
    if path == "amx-emulated":
        qe.select_isa(before)
        qe.emulate_amx()
    else:
        qe.select_isa(path)
    try:
        yield
    finally:
        qe.select_isa(before)


def _blocks(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    """gguf-py's blocks of random rows; K-quants (which it cannot quantise): random valid blocks with
    planted extreme scales (``arch_models.k_blocks``)."""
    if kind in K_TYPES:
        return torch.from_numpy(k_blocks(kind, rows, width, seed).copy())
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, width)).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block
    return torch.from_numpy(quantize(values, GGMLQuantizationType[kind]).copy())


def _width(kind: str) -> int:
    """160 inputs (5 blocks), or for a K-quant 512 (2 super-blocks: a tile's cells one after the other)."""
    return 512 if kind in K_TYPES else 160


def _rows(count: int, width: int, seed: int) -> torch.Tensor:
    x = torch.randn(count, width, generator=torch.Generator().manual_seed(seed)) * 2
    x[0, :32] = 0.0  # a zero block of rows (int8 scale 0)
    return x


TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
ROW_COUNTS = [1, 2, 3, 5, 7, 16, 17, 40]


def _emulated_available():
    if not HAS_AVX512:
        pytest.skip("the emulated AMX kernels' other steps are AVX-512; this CPU has no avx512 path")


@pytest.mark.parametrize("path", VECTOR_PATHS + ["amx-emulated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, "bfloat16-emulated"])
@pytest.mark.parametrize("kind", TYPES)
def test_every_path_equals_the_reference_bitwise_for_float32_and_int8_rows(path, dtype, kind):
    if path == "amx-emulated":
        _emulated_available()
    numerics = quant.Numerics(torch.bfloat16, quant.LAYOUT_FLOAT32_FMA, True) if dtype == "bfloat16-emulated" \
        else numerics_for(dtype)
    width = _width(kind)
    weight = QuantWeight(_blocks(kind, 72, width, seed=1), getattr(quant, kind), width, numerics)  # 4.5 tiles
    x = _rows(max(ROW_COUNTS), width, seed=2)
    with kernels("portable"):
        reference = weight.multiply(x)
    with kernels(path):
        for count in ROW_COUNTS:
            assert torch.equal(weight.multiply(x[:count].contiguous()), reference[:count]), count
        assert torch.equal(weight.multiply(x[5:6].contiguous()), reference[5:6])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("kind", TYPES)
def test_every_path_finds_each_rows_first_maximum_while_it_multiplies(path, dtype, kind):
    """``QuantWeight.multiply_with_maxima``: the product is ``multiply``'s bitwise and each row's index is
    ``first_maxima``'s of it, for 1-40 rows on 1-3 threads, over 200 outputs (13 tiles: several chunks
    a thread). A planted tie: the largest weight row copied to a later chunk's column, row 0 that row
    itself, so both columns hold row 0's largest value (the fold's ties on planted values: below)."""
    from tierspec.sampling import first_maxima

    width = _width(kind)
    raw = _blocks(kind, 200, width, seed=11).clone()
    dense = QuantWeight(raw, getattr(quant, kind), width, numerics_for(torch.float32)).dense()
    largest = int(dense.norm(dim=1).argmax())
    copy = (largest + 100) % 200
    raw[copy] = raw[largest]
    weight = QuantWeight(raw, getattr(quant, kind), width, numerics_for(dtype))
    x = _rows(max(ROW_COUNTS), width, seed=12)
    x[0] = dense[largest]
    threads = torch.get_num_threads()
    try:
        with kernels(path):
            for count in (1, 2, 3):
                torch.set_num_threads(count)
                for rows in ROW_COUNTS:
                    product, maxima = weight.multiply_with_maxima(x[:rows].contiguous())
                    assert torch.equal(product, weight.multiply(x[:rows].contiguous())), (count, rows)
                    assert maxima == first_maxima(product), (count, rows)
                    assert product[0, copy] == product[0, largest], (count, rows)
                    assert product[0].max() == product[0, largest], (count, rows)  # the tie is the maximum
                    assert maxima[0] == min(largest, copy), (count, rows)  # and the first column wins
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_products_maxima_keep_the_first_of_equal_values_and_give_nan_rows_minus_one(path, threads):
    """Each path's ``first_max`` and the fold over chunks, on planted outputs: zero rows added to them
    (``accumulate``) leave them as they are, and each row's index is ``first_maxima``'s. Over 1,000
    outputs (chunks of 32-112 columns, the last tile 8 wide): equal maxima in one chunk's different
    vectors and in different chunks (the first wins), all −inf (0), +inf twice, a NaN after the
    maximum and one alone in the last tile (−1), −0.0 before 0.0 (equal: the first), a maximum in the
    last tile's lanes, one in the first column."""
    from tierspec.sampling import first_maxima

    weight = QuantWeight(_blocks("Q8_0", 1000, 160, seed=13), quant.Q8_0, 160, numerics_for(torch.int8))
    planted = torch.randn(10, 1000, generator=torch.Generator().manual_seed(14))
    planted[0, 5] = planted[0, 21] = planted[0, 990] = 9.0
    planted[1] = float("-inf")
    planted[2, 77] = planted[2, 33] = float("inf")
    planted[3, 10], planted[3, 180] = 9.0, float("nan")
    planted[4] = 0.0
    planted[4, 3] = -0.0
    planted[5, 996] = 9.0
    planted[6, 0] = 9.0
    planted[7, 999] = float("nan")
    planted[8, 500] = planted[8, 700] = 9.0
    planted[9, 17] = planted[9, 2] = 9.0
    out, zeros = planted.clone(), torch.zeros(10, 160)
    kept = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with kernels(path):
            maxima = qe.matmul(weight=weight.handle, x=zeros.data_ptr(), rows=10, out=out.data_ptr(),
                               out_stride=1000, accumulate=True, threads=engine.engine_threads(), maxima=True)
            assert engine.probe()["paths"]["first_max"] == {"portable": "portable", "avx2": "avx2"}.get(path, "avx512")
    finally:
        torch.set_num_threads(kept)
    assert torch.equal(out.nan_to_num(), planted.nan_to_num())
    assert maxima == first_maxima(out) == [5, 0, 33, -1, 0, 996, 0, -1, 500, 2]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_path_draws_keyed_rows_in_the_product_as_the_extension_draws_them_after(path, threads):
    """``matmul(keys=..., temperatures=...)``: each keyed row's token is ``sampling.keyed_tokens`` of that row of the
    written product divided by its temperature (bit for bit: the chunks' perturbed maxima joined), for 1-40
    rows over 3,000 outputs (many chunks a thread); rows without a key are not drawn (−2) and the maxima are
    ``first_maxima``'s. Planted rows: a NaN (−1), a +inf and an all −inf row (left to the extension: −2), scores
    beyond the AVX-512 scan's float32 bound (its AVX2 scan), −inf among finite scores, a tie of the top value
    in two chunks, and rows of a few large scores where the noise rarely moves the token."""
    from tierspec.sampling import NOT_DRAWN, first_maxima, keyed_tokens

    vocab = 3000
    weight = QuantWeight(_blocks("Q8_0", vocab, 64, seed=21), quant.Q8_0, 64, numerics_for(torch.int8))
    generator = torch.Generator().manual_seed(22)
    planted = torch.randn(40, vocab, generator=generator) * 4
    planted[1, 7] = float("nan")
    planted[2, 2500] = float("inf")
    planted[3] = float("-inf")
    planted[4] *= 1000.0  # |top| beyond KEYED_WIDEST_TOP
    planted[5, ::3] = float("-inf")
    planted[6, 100] = planted[6, 2900] = 40.0
    planted[7, 1234] += 12.0
    zeros = torch.zeros(40, 64)
    keys = [int(k) * 4 + 3 for k in torch.randint(0, 2**61, (40,), generator=generator)]  # beyond 2**63 too
    temperatures = [(1.0, 0.7, 1.3, 0.05)[m % 4] for m in range(40)]
    kept = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with kernels(path):
            for rows in ROW_COUNTS:
                chosen = [None if m % 5 == 4 else keys[m] for m in range(rows)]
                out = planted[:rows].clone()
                maxima, draws = qe.matmul(weight=weight.handle, x=zeros.data_ptr(), rows=rows, out=out.data_ptr(),
                                          out_stride=vocab, accumulate=True, threads=engine.engine_threads(), maxima=True,
                                          keys=chosen, temperatures=temperatures[:rows])
                assert torch.equal(out.nan_to_num(), planted[:rows].nan_to_num())
                assert maxima == first_maxima(out)
                for m in range(rows):
                    if chosen[m] is None or m in (2, 3):
                        assert draws[m] == NOT_DRAWN, (rows, m)
                    elif m == 1:
                        assert draws[m] == -1, rows
                    else:  # the extension's draw of the row as sampling divides it (x / t in float32)
                        row = out[m : m + 1] / temperatures[m] if temperatures[m] != 1.0 else out[m : m + 1]
                        assert draws[m] == keyed_tokens(row, [chosen[m]])[0], (rows, m)
            assert engine.probe()["paths"]["keyed_max"] == {"portable": "portable", "avx2": "avx2"}.get(path, "avx512")
    finally:
        torch.set_num_threads(kept)


def _tie_planted_on_the_division(vocab: int, temperature: float, key: int) -> tuple[torch.Tensor, int, int]:
    """A row whose draw at ``temperature`` needs the division x / t itself: token ``late`` scores x with
    fl(x / t) one unit below fl(x · fl(1 / t)), token ``early`` (a lower index) scores y with
    fl(fl(y / t) + g_early) equal to fl(fl(x / t) + g_late), every other token far below. Dividing, the two tie
    and the earlier token wins; multiplying by the reciprocal, ``late`` wins. Returns (row, early, late)."""
    import numpy as np

    from tierspec.sampling import gumbel_values

    t = np.float32(temperature)
    reciprocal = np.float32(1.0) / t
    early, late = 5, vocab - 7  # in different chunks of the product
    g_early, g_late = (float(v) for v in gumbel_values(key, torch.tensor([early, late]), vocab))
    x = np.float32(60.0)
    while True:  # the scores are ~90 after the division: a unit there (2^-17) outlives adding a Gumbel value
        x = np.nextafter(x, np.float32(np.inf), dtype=np.float32)
        if x * reciprocal > x / t and np.float32(x * reciprocal + np.float32(g_late)) > np.float32(x / t + np.float32(g_late)):
            goal = np.float32(x / t + np.float32(g_late))
            y = np.float32((float(goal) - g_early) * float(t))
            for _ in range(400):  # the float32 y whose perturbed score is the goal, if one is near
                score = np.float32(y / t + np.float32(g_early))
                if score == goal:
                    row = torch.full((vocab,), -1000.0)
                    row[early], row[late] = float(y), float(x)
                    return row, early, late
                y = np.nextafter(y, np.float32(np.inf) if score < goal else np.float32(-np.inf), dtype=np.float32)


@pytest.mark.parametrize("path", PATHS)
def test_a_planted_tie_shows_the_draw_divides_by_the_temperature(path):
    """Drawn in the product at temperature 0.7, a row planted so that only x / t (not x · (1 / t)) ties two
    tokens' perturbed scores gives the earlier token — the extension's draw of the divided row — and the
    reciprocal's draw would have given the other (checked here, so the plant is known to tell them apart)."""
    from tierspec.sampling import keyed_tokens

    vocab, key, temperature = 3000, 987654321, 0.7
    row, early, late = _tie_planted_on_the_division(vocab, temperature, key)
    reciprocal = torch.tensor(1.0) / torch.tensor(temperature)
    assert keyed_tokens((row / temperature)[None], [key]) == [early]
    assert keyed_tokens((row * reciprocal)[None], [key]) == [late]
    weight = QuantWeight(_blocks("Q8_0", vocab, 64, seed=24), quant.Q8_0, 64, numerics_for(torch.int8))
    out, zeros = row[None].clone(), torch.zeros(1, 64)
    with kernels(path):
        _, draws = qe.matmul(weight=weight.handle, x=zeros.data_ptr(), rows=1, out=out.data_ptr(), out_stride=vocab,
                             accumulate=True, threads=engine.engine_threads(), maxima=True, keys=[key],
                             temperatures=[temperature])
    assert draws == [early]


def test_a_product_draws_only_rows_it_is_given_keys_and_temperatures_for():
    """Keys need the maxima and one temperature a row; a temperature at or below 0 or not finite is refused
    before anything is computed."""
    weight = QuantWeight(_blocks("Q8_0", 64, 32, seed=23), quant.Q8_0, 32, numerics_for(torch.int8))
    x, out = torch.ones(2, 32), torch.zeros(2, 64)
    call = dict(weight=weight.handle, x=x.data_ptr(), rows=2, out=out.data_ptr(), out_stride=64, accumulate=False,
                threads=1, keys=[1, None])
    with pytest.raises(ValueError, match="maxima"):
        qe.matmul(**call, temperatures=[1.0, 1.0])
    with pytest.raises(ValueError, match="2 rows need 2 keys and temperatures"):
        qe.matmul(**call, maxima=True, temperatures=[1.0])
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            qe.matmul(**call, maxima=True, temperatures=[bad, 1.0])
    assert torch.equal(out, torch.zeros(2, 64))
    maxima, draws = qe.matmul(**call, maxima=True, temperatures=[1.0, 1.0])
    assert draws[1] == -2 and draws[0] >= 0
    # a temperature subnormal in float32 (read as 0 where the engine flushes denormals): left to the extension
    assert qe.matmul(**call, maxima=True, temperatures=[1e-45, 1.0])[1] == [-2, -2]


# each K-quant's bytes of stored values (the rest of a block: its scales) as (start, stop) per block
_K_VALUE_BYTES = {"Q4_K": (144, [(16, 144)]), "Q5_K": (176, [(16, 176)]), "Q6_K": (210, [(0, 192)])}


def _extreme_blocks(kind: str, rows: int, width: int) -> torch.Tensor:
    """Raw blocks at the integers' bounds, which random weights never reach, in whole blocks of one
    value, alternating, and mixed: Q8 values -128 and 127, Q4 nibbles 15 and 0 (scale 1, Q4_1's m 0);
    K-quants (random valid scales from ``k_blocks``) with every value bit set or clear: Q4_K 15 / 0,
    Q5_K 31 / 0, Q6_K's u = q + 32 63 / 0."""
    rng = np.random.default_rng(17)
    if kind in K_TYPES:
        size, spans = _K_VALUE_BYTES[kind]
        blocks = k_blocks(kind, rows, width, seed=17).reshape(rows, -1, size).copy()
        for n in range(rows):
            for start, stop in spans:
                blocks[n, :, start:stop] = [0xFF, 0x00, np.tile(np.uint8([0xFF, 0x00]), (stop - start) // 2),
                                            blocks[n, :, start:stop]][n % 4]
        return torch.from_numpy(blocks.reshape(rows, -1))
    q8 = kind == "Q8_0"
    high, low = (-128, 127) if q8 else (15, 0)
    values = np.empty((rows, width), np.int64)
    for n in range(rows):
        values[n] = [high, low, np.tile([high, low], width // 2),
                     rng.integers(-128, 128, width) if q8 else rng.integers(0, 16, width)][n % 4]
    blocks = values.reshape(rows, -1, 32)
    one = np.full(blocks.shape[:2] + (1,), np.float16(1.0)).view(np.uint8)  # fp16 1.0 as two bytes
    if q8:
        body = blocks.astype(np.int8).view(np.uint8)
    else:  # byte i: value i (low nibble), value 16 + i (high nibble)
        body = (blocks[..., :16] | (blocks[..., 16:] << 4)).astype(np.uint8)
    head = [one] if kind != "Q4_1" else [one, np.zeros_like(one)]
    return torch.from_numpy(np.concatenate(head + [body], axis=-1).reshape(rows, -1).copy())


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("kind", TYPES)
def test_int8_rows_at_the_integer_bounds_equal_the_reference_bitwise(path, kind):
    """8-bit rows of +-127 against weights at their bounds: where a kernel's narrow integer sums
    (AVX2's int16 pairs) could saturate or a sign trick could wrap, the exact sums must still come out."""
    width = 512 if kind in K_TYPES else 96
    weight = QuantWeight(_extreme_blocks(kind, 32, width), getattr(quant, kind), width, numerics_for(torch.int8))
    signs = torch.tensor([1.0, -1.0]).repeat(width // 2)
    x = torch.stack([torch.ones(width), -torch.ones(width), signs, -signs,
                     torch.randn(width, generator=torch.Generator().manual_seed(3))])
    with kernels("portable"):
        reference = weight.multiply(x)
    # the planted sums themselves: row 0 of x is all 127 after rounding (scale 1/127), so output n's
    # value is the sum of its weights, to float32 rounding of the blocks' float steps (a saturated
    # int16 sum would be off by thousands of units of a block's scale)
    dense = weight.dense()
    assert torch.allclose(reference[0], dense.sum(1), rtol=0, atol=1e-5 * float(dense.abs().sum(1).max()))
    with kernels(path):
        assert torch.equal(weight.multiply(x), reference)
        for row in range(len(x)):
            assert torch.equal(weight.multiply(x[row : row + 1].contiguous()), reference[row : row + 1])


def _summed_terms(kind: str, raw: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """[N, K]: the magnitude each weight brings to the bfloat16 kernels' sums. The kernels of the
    kinds with a minimum (Q4_0, Q4_1, Q4_K, Q5_K: w = d·q + m per 32, K-quants' d = d·sc, m = −dmin·mn)
    sum d·(128 + q_k)·x_k and add (m − 128 d)·Σx (docs/algorithms.md §The pass engine), so such a
    weight brings |128 d + w − m| + |m − 128 d| (d·(128 + q) = 128 d + w − m); a Q8_0 or Q6_K weight |w|."""
    if kind in ("Q8_0", "Q6_K"):
        return dense.abs()
    rows = raw.shape[0]
    if kind in ("Q4_K", "Q5_K"):
        blocks = raw.numpy().reshape(rows, -1, 144 if kind == "Q4_K" else 176)
        half = lambda at: blocks[..., at : at + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731
        s = blocks[..., 4:16]  # the 6-bit scales and minimums, unpacked as ggml does
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
        d = torch.from_numpy((half(0) * sc).reshape(rows, -1, 1))  # [N, K/32, 1]
        m = torch.from_numpy((-(half(2) * mn)).reshape(rows, -1, 1))
    else:
        blocks = raw.numpy().reshape(rows, -1, 18 if kind == "Q4_0" else 20)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16).astype(np.float32))  # [N, K/32, 1]
        m = -8 * d if kind == "Q4_0" else torch.from_numpy(blocks[..., 2:4].copy().view(np.float16).astype(np.float32))
    w = dense.reshape(d.shape[0], d.shape[1], 32)
    return ((128 * d + w - m).abs() + (m - 128 * d).abs()).reshape(dense.shape)


@pytest.mark.parametrize("path", (["avx512bf16"] if NATIVE_BF16 else []) + ["amx-emulated"]
                         + (["amx"] if "amx" in PATHS else []))
@pytest.mark.parametrize("kind", TYPES)
def test_bfloat16_dot_products_match_the_reference_within_their_rounding(path, kind):
    """bfloat16 dot products sum pairs of k in the instruction's order: each output within 4 float32
    ulps of the magnitude of the terms it sums (``_summed_terms``) of the reference's, which sums
    them in order."""
    if path == "amx-emulated":
        _emulated_available()
    numerics = quant.Numerics(torch.bfloat16, quant.LAYOUT_BFLOAT16_DOT, False)
    width = _width(kind)
    raw = _blocks(kind, 72, width, seed=3)
    weight = QuantWeight(raw, getattr(quant, kind), width, numerics)
    x = _rows(40, width, seed=4)
    with kernels("portable"):
        reference = weight.multiply(x)
    rounded = x.to(torch.bfloat16).float()
    magnitude = (rounded.abs().double() @ _summed_terms(kind, raw, weight.dense()).double().t()).float()
    with kernels(path):
        for count in ROW_COUNTS:
            got = weight.multiply(x[:count].contiguous())
            assert ((got - reference[:count]).abs() <= 4 * 2 ** -23 * magnitude[:count] + 1e-30).all(), count
            # the row contract: a row's result does not depend on the rows beside it
            assert torch.equal(weight.multiply(x[count - 1 : count].contiguous()), got[-1:])


# the AMX int8 tiles take 64 rows and more (kernels_amx.c), VNNI's kernel fewer, both the reference's bits
AMX_INT8_ROW_COUNTS = [1, 16, 63, 64, 65, 127, 128, 150, 256, 257, 300]  # a call takes up to 256 rows


@pytest.mark.skipif("amx" not in PATHS, reason=f"no AMX here: {AMX_REASON}")
@pytest.mark.parametrize("kind", TYPES)
def test_the_amx_int8_tiles_equal_the_reference_bitwise(kind):
    width = _width(kind)
    weight = QuantWeight(_blocks(kind, 72, width, seed=5), getattr(quant, kind), width, numerics_for(torch.int8))
    x = _rows(max(AMX_INT8_ROW_COUNTS), width, seed=6)
    with kernels("portable"):
        reference = weight.multiply(x)
    with kernels("amx"):
        assert engine.probe()["paths"]["int8"] == "amx"
        for count in AMX_INT8_ROW_COUNTS:
            assert torch.equal(weight.multiply(x[:count].contiguous()), reference[:count]), count


@pytest.mark.parametrize("kind", TYPES)
def test_the_emulated_tiles_compute_what_the_instructions_define(kind):
    """The AMX kernels' reference (their tile math in plain C) against the reference kernel: an int8
    weight's products equal it exactly, whatever the row count (tiles from 64 rows, VNNI's below)."""
    _emulated_available()
    width = _width(kind)
    weight = QuantWeight(_blocks(kind, 40, width, seed=7), getattr(quant, kind), width, numerics_for(torch.int8))
    x = _rows(max(AMX_INT8_ROW_COUNTS), width, seed=8)
    with kernels("portable"):
        reference = weight.multiply(x)
    with kernels("amx-emulated"):
        assert engine.probe()["paths"]["int8"] == "amx"
        for count in AMX_INT8_ROW_COUNTS:
            assert torch.equal(weight.multiply(x[:count].contiguous()), reference[:count]), count


def test_the_native_block_types_are_the_packages():
    assert {t: name for t, (name, _, _) in qe.block_types().items()} == quant.NATIVE_TYPES
    sizes = ggml_type_sizes()
    assert {t: (inputs, size) for t, (_, inputs, size) in qe.block_types().items()} == \
        {t: tuple(sizes[t]) for t in quant.NATIVE_TYPES}
    assert {t: value for t, value in quant._BLOCKS.items()} == {t: tuple(sizes[t]) for t in quant.NATIVE_TYPES}


def test_k_quant_cells_stream_about_the_files_bytes():
    """The cells' sizes (blocks.h): Q4_K 2368, Q5_K 2880, Q6_K 3360 bytes per 16 rows x 256 inputs,
    1.03x, 1.02x and 1.00x the file's blocks."""
    for kind, cell in (("Q4_K", 2368), ("Q5_K", 2880), ("Q6_K", 3360)):
        weight = QuantWeight(_blocks(kind, 32, 512, seed=0), getattr(quant, kind), 512, numerics_for(torch.float32))
        assert weight.nbytes == 2 * 2 * cell  # 2 tiles x 2 super-blocks


# ---- the row contract on every path, through the fused model -----------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf-kernels"), seed=11)


#: Longer than a chunk of a long pass on every path (``engine.probe()["pass_rows"]``: 64, or the AMX path's 256).
LONG_PROMPT = (torch.arange(300) * 37 + 5) % 256
CONTRACT_NUMERICS = [torch.float32, torch.int8] + ([torch.bfloat16] if NATIVE_BF16 else [])


def _threads(count: int):
    @contextlib.contextmanager
    def arranged():
        before = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            yield
        finally:
            torch.set_num_threads(before)
    return arranged()


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    """A Llama 3 file of llama.cpp's Q4_K_M mix (Q4_K; v, down and the head Q6_K where it puts them)."""
    return write_arch_gguf(tmp_path_factory.mktemp("tiny-q4-k-m"), "llama3", "Q4_K_M", seed=12)


def _load(which: str, tiny, tiny_q4_k_m, numerics):
    if which == "Q4_1":
        return load_gguf_llama(tiny.gguf, tiny.folder, numerics)
    from tierspec.gguf_model import build_gguf_model
    from tierspec.quant import read_gguf_tensors

    tensors, fields = read_gguf_tensors(tiny_q4_k_m.gguf)
    model = build_gguf_model(tiny_q4_k_m.gguf, tensors, fields, numerics, torch.float32, quiet=True)
    assert model.model.engine_stack is not None
    return model


@pytest.mark.parametrize("which", ["Q4_1", "Q4_K_M"])
@pytest.mark.parametrize("path", PATHS + ("amx-emulated",))
@pytest.mark.parametrize("dtype", CONTRACT_NUMERICS)
def test_a_tokens_logits_do_not_depend_on_its_pass_or_the_threads_on_every_path(tiny, tiny_q4_k_m, which, path, dtype):
    if path == "amx-emulated":
        _emulated_available()
    model = _load(which, tiny, tiny_q4_k_m, numerics_for(dtype))
    runner = CachedModel(model)
    with torch.inference_mode(), kernels(path):
        chunk = engine.probe()["pass_rows"]
        prompt = LONG_PROMPT[: chunk + 16]
        with _threads(2):
            whole = runner.forward(prompt).logits  # one pass of a chunk and 16 rows: two chunks
            runner.rollback(0)
            alone = torch.cat([runner.forward(prompt[i : i + 1]).logits for i in range(16)])
        assert torch.equal(alone, whole[:16])
        # (start, width): passes inside the first chunk, and one across where the long pass was cut
        for start, width in ((7, 2), (7, 3), (7, 8), (7, 64), (chunk - 4, 20)):
            for threads in (1, 3):
                with _threads(threads):
                    if runner.length < start:  # the cache refilled up to the pass's start
                        runner.forward(prompt[runner.length : start])
                    runner.rollback(start)
                    inside = runner.forward(prompt[start : start + width]).logits
                assert torch.equal(inside, whole[start : start + width]), (start, width, threads)


@pytest.mark.parametrize("path", PATHS + ("amx-emulated",))
def test_a_tree_node_gets_its_chains_logits_on_every_path(tiny, path):
    from tierspec.tree import TokenTree, tree_pass

    if path == "amx-emulated":
        _emulated_available()
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.int8))
    runner = CachedModel(model)
    paths = [[11, 12, 13], [11, 40], [60, 61, 62, 63]]
    tree = TokenTree.from_paths(paths)
    with torch.inference_mode(), kernels(path):
        runner.forward(LONG_PROMPT[:20])
        layout = tree_pass(torch.tensor([5]), tree)
        tree_logits = runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits
        runner.rollback(20)
        for branch in paths:
            chain = runner.forward(torch.tensor([5] + branch)).logits
            runner.rollback(20)
            rows = []
            node = -1
            for token in branch:
                node = next(i for i in range(len(tree)) if int(tree.parents[i]) == node and int(tree.tokens[i]) == token)
                rows.append(1 + node)
            assert torch.equal(tree_logits[rows], chain[1:])


@pytest.mark.parametrize("dtype", CONTRACT_NUMERICS)
def test_a_long_pass_in_chunks_equals_one_row_at_a_time(tiny, dtype):
    """A prefill longer than the engine's chunk (its rows run through all layers chunk by chunk)
    gives every token exactly its one-row pass's logits and hidden states."""
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(dtype))
    runner = CachedModel(model)
    with torch.inference_mode():
        whole = runner.forward(LONG_PROMPT, with_hidden=True, hidden_layers=(1,))
        runner.rollback(0)
        steps = [runner.forward(LONG_PROMPT[i : i + 1], with_hidden=True, hidden_layers=(1,)) for i in range(len(LONG_PROMPT))]
    assert torch.equal(torch.cat([s.logits for s in steps]), whole.logits)
    assert torch.equal(torch.cat([s.hidden for s in steps]), whole.hidden)


def _captured(model, hooked: bool, mask=None):
    """Features and every hooked layer's (input, output) over a prefill and a 2-row pass, layers
    0-2 hooked, 1 and 2 captured as features; ``hooked``: a plain (non-observer) hook on them too, so that they run as module
    calls instead of inside the engine's call."""
    seen = {0: [], 1: [], 2: []}
    handles = []
    for index in seen:
        def hook(module, args, output, index=index):
            seen[index].append((args[0].clone(), output.clone()))
        hook.observes_only = not hooked
        handles.append(model.model.layers[index].register_forward_hook(hook))
    runner = CachedModel(model)
    with torch.inference_mode():
        first = runner.forward(LONG_PROMPT[:20], mask=mask, with_hidden=True, hidden_layers=(1, 2))
        second = runner.forward(LONG_PROMPT[20:22], mask=mask, with_hidden=True, hidden_layers=(1, 2))
    for handle in handles:
        handle.remove()
    return [first.logits, first.hidden, second.logits, second.hidden], seen


@pytest.mark.parametrize("masked", [False, True])
def test_hidden_states_captured_inside_the_engine_call_equal_the_module_calls(tiny, masked):
    """Observer hooks (``observes_only``, as HiddenCapture's) stay inside the engine's one call,
    which copies the layers' rows out: the features, logits and each hook's input and output are
    bitwise those of the hooked layers run as module calls, under a routing mask too."""
    from tierspec.layerskip.masks import RoutingMask

    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))
    mask = RoutingMask(3, unit="sublayer", skip_attention={1}, skip_mlp={1}) if masked else None
    inside, seen_inside = _captured(model, hooked=False, mask=mask)
    modules, seen_modules = _captured(model, hooked=True, mask=mask)
    for ours, theirs in zip(inside, modules):
        assert torch.equal(ours, theirs)
    for index in seen_inside:
        # every layer once a pass, either way: an engine layer the mask bypasses whole keeps its place
        # with both units bypassed (layerskip.masks._swap_in), its output its input
        assert len(seen_inside[index]) == len(seen_modules[index]) == 2
        for (given, output), (given_m, output_m) in zip(seen_inside[index], seen_modules[index]):
            assert torch.equal(given, given_m) and torch.equal(output, output_m)
            assert torch.equal(given, output) == (masked and index == 1)


def test_an_observer_hook_that_returns_a_value_is_an_error(tiny):
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))

    def hook(module, args, output):
        return output * 2

    hook.observes_only = True
    handle = model.model.layers[1].register_forward_hook(hook)
    try:
        with torch.inference_mode(), pytest.raises(RuntimeError, match="observes_only"):
            CachedModel(model).forward(LONG_PROMPT[:5])
    finally:
        handle.remove()


@pytest.mark.parametrize("path", PATHS)
def test_the_fused_model_matches_torchs_operators_on_every_path(tiny, path):
    """Norms, attention and exp of every path (their own orders of sums) within float32 rounding."""
    model, reference = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32)), tiny.reference()
    with torch.inference_mode(), kernels(path):
        ours = CachedModel(model).forward(LONG_PROMPT[:40]).logits
    theirs = CachedModel(reference).forward(LONG_PROMPT[:40]).logits
    assert (ours - theirs).abs().max() <= 2e-5 * theirs.abs().max()


# ---- the cap, the probe and bad calls ---------------------------------------------------------------


def _engine_in_a_child(isa: str) -> subprocess.CompletedProcess:
    code = "from tierspec import engine; print(engine.kernel_path()); print(engine.kernel_report())"
    env = {**os.environ, "TIERSPEC_ENGINE_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_an_unknown_isa_cap_is_refused_at_import_with_the_valid_ones():
    done = _engine_in_a_child("avx3")
    assert done.returncode != 0
    assert "TIERSPEC_ENGINE_ISA=avx3 is not a kernel path; use one of: portable avx2 avx512 avx512vnni avx512bf16 amx" \
        in done.stderr


@pytest.mark.parametrize("isa", ["portable", "avx2"])
def test_a_cap_holds_the_engine_at_or_below_it(isa):
    done = _engine_in_a_child(isa)
    assert done.returncode == 0, done.stderr
    path, report = done.stdout.splitlines()
    assert path == isa or (isa == "avx2" and path == "portable" and "avx2" not in PATHS)
    assert f"capped by TIERSPEC_ENGINE_ISA={isa}" in report and "AMX not used: not probed" in report


def test_the_probe_reports_what_the_kernels_do():
    found = engine.probe()
    assert found["isa"] == qe.isa() == PATHS[-1]
    assert found["amx"] == ("amx" in PATHS)
    assert found["amx"] or found["amx_reason"]
    if found["features"]["avx512vnni"] and found["features"]["os_zmm"] and found["cap"] in (None, "amx", "avx512bf16",
                                                                                             "avx512vnni"):
        assert found["paths"]["int8"] in ("avx512vnni", "amx")  # VNNI without AVX512-BF16 counts
    if found["isa"] in ("avx512", "avx512vnni", "avx512bf16", "amx"):  # its keyed draws count leading zeros with CD
        assert found["features"]["avx512cd"] and found["paths"]["keyed_max"] == "avx512"
    assert engine.kernel_report().startswith(f"engine kernels {found['isa']} (")
    with pytest.raises(ValueError, match="not one this process runs"):
        qe.select_isa("avx9000")


def test_bad_calls_are_refused_before_anything_runs(tiny):
    weight = QuantWeight(_blocks("Q4_1", 32, 64, seed=9), quant.Q4_1, 64, numerics_for(torch.float32))
    with pytest.raises(ValueError, match="float32 contiguous rows"):
        weight.multiply(torch.randn(3, 32))
    with pytest.raises(IndexError):
        weight.rows(torch.tensor([32]))
    with pytest.raises(IndexError):
        weight.select(torch.tensor([-1]))
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))
    stack = model.model.engine_stack.capsule
    hidden, cos = torch.zeros(4, 64), torch.ones(4, 16)
    keys, values = torch.zeros(2, 2, 16), torch.zeros(2, 2, 16)  # [kv_heads, 2 slots, D]: a pass of 4 needs 4
    small = torch.tensor([[keys.data_ptr(), values.data_ptr(), 2, 4]] * 3)
    with pytest.raises(ValueError, match="holds 2 slots, the pass needs 4"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, small)], [(cos, cos)],
                         bytes([3, 3, 3]))
    big = torch.zeros(2, 8, 16)
    for size in (8, 1, 0):  # an element size the engine does not read
        odd = torch.tensor([[big.data_ptr(), big.data_ptr(), 8, size]] * 3)
        with pytest.raises(ValueError, match=f"layer 0 has {size}-byte elements: float32 .4. or float16 .2. only"):
            engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, odd)], [(cos, cos)],
                             bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="int64 \\[layers, 4\\]"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, small[:, :3].contiguous())],
                         [(cos, cos)], bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="cover"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 1, 0, small)], [(cos, cos)],
                         bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="a row for each"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, small[:1])],
                         [(cos, cos)], bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="rotary table 0 of width 16; the pass has 1 table.s. of width 8"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, small)],
                         [(cos[:, :8].contiguous(), cos[:, :8].contiguous())], bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="positions are int64 \\[4\\]"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 4, 0, small, positions=torch.arange(3))],
                         [(cos, cos)], bytes([3, 3, 3]))
    assert torch.equal(hidden, torch.zeros(4, 64)) and torch.equal(keys, torch.zeros(2, 2, 16))  # nothing ran
    assert torch.equal(big, torch.zeros(2, 8, 16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("width", [64, 576, 50])  # 50: not a multiple of a vector (the kernels' scalar tail)
def test_the_engines_norm_is_rms_norm_on_every_path(path, width):
    """``engine.rms_norm`` (a model's final norm after the stack call) against x / rms(x) · w in
    float64, on every path, with a zero row and rows of very different scales; refused inputs change
    nothing."""
    x = torch.randn(5, width, generator=torch.Generator().manual_seed(width)) * torch.tensor([[1e-3], [1.0], [30.0], [0.0], [5.0]])
    weight = torch.randn(width, generator=torch.Generator().manual_seed(1))
    wide = x.double()
    expected = wide / torch.sqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    with kernels(path):
        got = engine.rms_norm(x, weight, 1e-6)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.allclose(got.double(), expected, rtol=2e-6, atol=1e-6 * float(expected.abs().max()))
    assert torch.equal(got[3], torch.zeros(width))
    before = x.clone()
    with pytest.raises(ValueError, match="contiguous float32"):
        engine.rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(ValueError, match="contiguous float32"):
        engine.rms_norm(x.t(), weight, 1e-6)
    with pytest.raises(ValueError, match=f"weight \\[{width}\\]"):
        engine.rms_norm(x, weight[:-1].contiguous(), 1e-6)
    assert torch.equal(x, before)


def test_the_final_norm_runs_on_the_engine_unless_the_module_is_hooked(tiny, monkeypatch):
    """A pass's final norm: the engine's kernel (within float32 rounding of torch's rms_norm; a
    pass calls it once), and the module itself (its hooks called, its output theirs) when a hook is
    on it."""
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))
    decoder = model.model
    calls = []
    kernel = engine.rms_norm
    monkeypatch.setattr(engine, "rms_norm", lambda *args: calls.append(1) or kernel(*args))
    hidden = torch.randn(3, decoder.norm.weight.shape[0], generator=torch.Generator().manual_seed(3))
    on_engine = decoder.final_norm(hidden)
    by_module = decoder.norm(hidden)
    assert len(calls) == 1 and (on_engine - by_module).abs().max() <= 1e-6 * by_module.abs().max()
    with torch.inference_mode():
        CachedModel(model).forward(LONG_PROMPT[:4])
    assert len(calls) == 2
    seen = []
    handle = decoder.norm.register_forward_hook(lambda module, args, output: seen.append(output) or output * 2)
    try:
        hooked = decoder.final_norm(hidden)
        assert len(seen) == 1 and torch.equal(hooked, seen[0] * 2)
        with torch.inference_mode():
            CachedModel(model).forward(LONG_PROMPT[:4])
        assert len(seen) == 2 and len(calls) == 2  # the pass went through the hooked module, not the kernel
    finally:
        handle.remove()


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_every_paths_layers_match_the_reference_path(tiny, path):
    """The vector norm, exp and attention of a path (each summing over its lanes) against the plain-C
    reference's, through the same layers: float32 logits within a few ulps of their scale, and the
    same greedy tokens."""
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))
    with torch.inference_mode():
        with kernels("portable"):
            reference = CachedModel(model).forward(LONG_PROMPT[:70]).logits
        with kernels(path):
            got = CachedModel(model).forward(LONG_PROMPT[:70]).logits
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224])
def test_the_vector_attention_of_each_head_width_it_covers(tmp_path, path, head_dim):
    """The vector paths' attention kernels take every multiple of 32 up to 256 (96: Phi-3; 160: a width
    read at run time rather than compiled in; 256 below with Gemma 3; the tiny model's D = 16 runs the
    reference): within a few ulps of the reference path's logits, the same greedy tokens, and the row
    contract (a token alone = inside a long pass, whose 8-key groups and tails differ) on the path."""
    tiny = write_tiny_gguf(tmp_path, seed=5, layers=2, hidden=2 * head_dim, heads=2, kv_heads=1)
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.float32))
    prompt = LONG_PROMPT[:75]
    with torch.inference_mode():
        with kernels("portable"):
            reference = CachedModel(model).forward(prompt).logits
        with kernels(path):
            assert engine.probe()["paths"]["attention"] != "portable"
            runner = CachedModel(model)
            got = runner.forward(prompt).logits
            runner.rollback(60)
            alone = torch.cat([runner.forward(prompt[i : i + 1]).logits for i in range(60, 75)])
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(got.argmax(-1), reference.argmax(-1))
    assert torch.equal(alone, got[60:])


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(64, 6, 2), (128, 2, 1), (256, 2, 2)])
@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
def test_rows_attending_together_get_what_each_gets_alone(tmp_path, path, head_dim, heads, kv_heads, kv):
    """A pass's chain rows attend in blocks (``attend_rows``: a block of keys and values widened to
    float32 once for all the block's rows and heads, on the AVX2 and AVX-512 paths; a one-row pass's
    row too): every row gets bitwise what the one-row kernel (``attend``, which a masked row takes)
    gives it in a pass of its own — float32 and float16 caches, groups of 3, 2 and 1 query heads per
    kv head, rows whose keys end inside a block of 16 and odd and even key counts, a pass that begins
    after cached tokens, passes of 2-5 rows, one thread and two (the next test: attention on two threads)."""
    tiny = write_tiny_gguf(tmp_path, seed=7, layers=2, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads)
    model = load_gguf_llama(tiny.gguf, tiny.folder, dataclasses.replace(numerics_for(torch.float32), kv_dtype=kv))
    prompt = LONG_PROMPT[:90]
    one_node = {"offsets": torch.zeros(1, dtype=torch.long), "attends": torch.ones(1, 1, dtype=torch.bool)}
    with torch.inference_mode(), kernels(path):
        assert engine.probe()["paths"]["attention_rows"] == ("avx2" if path == "avx2" else "avx512")
        runner = CachedModel(model)
        qe.profile(True)
        alone = torch.cat([runner.forward(prompt[i : i + 1], **one_node).logits for i in range(len(prompt))])
        assert qe.profile(False)[4] == 0, "a masked row attended in a block: alone was not the one-row kernel"
        for threads in (1, 2):
            with _threads(threads):
                runner.rollback(0)
                qe.profile(True)
                whole = runner.forward(prompt).logits  # 64 rows, then 26
                runner.rollback(13)
                after = runner.forward(prompt[13:]).logits
                runner.rollback(40)
                chain_alone = torch.cat([runner.forward(prompt[i : i + 1]).logits for i in range(40, 46)])
                runner.rollback(46)
                few = [runner.forward(prompt[i : i + rows]).logits for i, rows in ((46, 2), (48, 3), (51, 4), (55, 5))]
                in_blocks = qe.profile(False)[4]
            assert in_blocks > 0, "no row attended in a block: the test compared one-row attention with itself"
            assert torch.equal(whole, alone), threads
            assert torch.equal(after, alone[13:]), threads
            assert torch.equal(chain_alone, alone[40:46]), threads
            assert torch.equal(torch.cat(few), alone[46:60]), threads


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("heads, kv_heads, tasks", [(9, 3, 4), (6, 2, 2), (4, 1, 2)])
def test_attention_tasks_shared_by_two_threads_give_each_row_what_it_gets_alone(tmp_path, path, heads, kv_heads, tasks):
    """Past a few hundred cached tokens a pass's attention runs on two threads: a sequence's few chain
    rows split in two blocks, and a one-row pass's groups of query heads halved until the threads share the
    tasks evenly (the default model's 9 heads on 3 kv heads: groups 3, 3, 2 and 1; 2 kv heads: as they are;
    Gemma 3 270M's 4 heads on one: two groups of 2; one thread's are not split).
    Every row gets bitwise what the one-row kernel gives it on one thread — one-row passes, passes of 2-5
    rows, masked rows."""
    head_dim, layers = 64, 2
    tiny = write_tiny_gguf(tmp_path, seed=11, layers=layers, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads)
    model = load_gguf_llama(tiny.gguf, tiny.folder, dataclasses.replace(numerics_for(torch.float32), kv_dtype=torch.float16))
    prompt = (torch.arange(330) * 37 + 5) % 256
    one_node = {"offsets": torch.zeros(1, dtype=torch.long), "attends": torch.ones(1, 1, dtype=torch.bool)}
    start = 300  # 9, 6 or 4 heads x 300 keys: past the engine's one-thread bound (1,024 head-keys)
    with torch.inference_mode(), kernels(path):
        runner = CachedModel(model)
        runner.forward(prompt[:start])
        with _threads(1):
            alone = torch.cat([runner.forward(prompt[i : i + 1], **one_node).logits for i in range(start, 330)])
        runner.rollback(start)
        with _threads(1):
            qe.profile(True)
            runner.forward(prompt[start : start + 1])
            tasks_on_one_thread = qe.profile(False)[5]
            runner.rollback(start)
        with _threads(2):
            qe.profile(True)
            runner.forward(prompt[start : start + 1])
            tasks_of_one_row = qe.profile(False)[5]
            runner.rollback(start)
            masked = torch.cat([runner.forward(prompt[i : i + 1], **one_node).logits for i in range(start, 316)])
            runner.rollback(start)
            chain = torch.cat([runner.forward(prompt[i : i + 1]).logits for i in range(start, 316)])
            qe.profile(True)
            few = [runner.forward(prompt[i : i + rows]).logits for i, rows in ((316, 2), (318, 3), (321, 4), (325, 5))]
            in_blocks = qe.profile(False)[4]
    assert tasks_on_one_thread == layers * kv_heads, "one thread's tasks were split"
    assert tasks_of_one_row == layers * tasks, "a one-row pass's attention tasks did not share two threads evenly"
    assert in_blocks == layers * 14
    assert torch.equal(masked, alone[:16])
    assert torch.equal(chain, alone[:16])
    assert torch.equal(torch.cat(few), alone[16:])


def test_the_cost_tables_key_names_the_numerics_and_the_kernel_path(tiny):
    """A cached pass-cost table is keyed by the engine's numerics and the path their kernels take
    here, so a new kernel (or a capped path) never reads an old table."""
    from tierspec.costs import _linear_kind

    keys = {}
    for dtype in (torch.int8, torch.float32):
        model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(dtype))
        keys[dtype] = _linear_kind(model)
        with kernels("portable"):
            keys[dtype, "portable"] = _linear_kind(model)
    assert keys[torch.int8] != keys[torch.float32] and keys[torch.int8, "portable"] != keys[torch.float32, "portable"]
    for dtype, name in ((torch.int8, "int8"), (torch.float32, "float32")):
        assert keys[dtype].endswith(":" + engine.probe()["paths"][name])
        assert keys[dtype, "portable"].endswith(":portable")


# ---- the architectures' layer features on every path --------------------------------------------------

FEATURE_FILES = ["mistral", "qwen2", "qwen3", "gemma3", "phi3", "gemma3-d256"]  # each beyond Llama's layer
ARCH_PROMPT = (torch.arange(30) * 53 + 3) % 256  # past the files' sliding window (8)


@pytest.fixture(scope="module")
def arch_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch-kernels")
    made = {}

    def get(name: str):
        if name not in made:
            arch, _, width = name.partition("-d")
            made[name] = write_arch_gguf(folder, arch, "Q8_0", seed=5, **({"head_dim": int(width)} if width else {}))
        return made[name]

    return get


def _engine_model(tiny, dtype=torch.float32, **changes):
    """The file's model on the engine (checked), its Architecture with ``changes`` (planted features)."""
    tensors, fields = read_gguf_tensors(tiny.gguf)
    arch = dataclasses.replace(read_architecture(fields, tensors), **changes)
    original = gguf_model.read_architecture
    gguf_model.read_architecture = lambda fields, tensors: arch
    try:
        model = gguf_model.build_gguf_model(tiny.gguf, tensors, fields, numerics_for(dtype), torch.float32, quiet=True)
    finally:
        gguf_model.read_architecture = original
    assert model.model.engine_stack is not None
    return model


# Gemma 3 with a scale of its own (query_pre_attn_scalar 24 instead of the head width) and soft-capped
# scores: no tiny file stores them, so they are planted in its Architecture and in transformers' config
PLANTED_SCALAR, PLANTED_CAP = 24, 3.0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("name", FEATURE_FILES)
def test_each_architectures_layer_keeps_the_row_contract_on_every_path(arch_file, name, dtype, path):
    """A token's logits alone = inside passes of 2-8 rows on 1 or 3 threads, and a token-tree node's =
    its chain's (past the sliding window: each node sees the window before its own position)."""
    from tierspec.tree import TokenTree, tree_pass

    model = _engine_model(arch_file(name), dtype)
    runner = CachedModel(model)
    with torch.inference_mode(), kernels(path):
        with _threads(2):
            whole = runner.forward(ARCH_PROMPT).logits
            runner.rollback(0)
            alone = torch.cat([runner.forward(ARCH_PROMPT[i : i + 1]).logits for i in range(len(ARCH_PROMPT))])
        assert torch.equal(alone, whole)
        for width in (2, 3, 8):
            for threads in (1, 3):
                with _threads(threads):
                    runner.rollback(WINDOW + 3)
                    inside = runner.forward(ARCH_PROMPT[WINDOW + 3 : WINDOW + 3 + width]).logits
                assert torch.equal(inside, whole[WINDOW + 3 : WINDOW + 3 + width]), (width, threads)
        runner.rollback(WINDOW + 3)
        runner.forward(ARCH_PROMPT[WINDOW + 3 :])
        paths = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11, 40], [60, 61, 62]]  # the first longer than the window
        tree = TokenTree.from_paths(paths)
        layout = tree_pass(torch.tensor([5]), tree)
        tree_logits = runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits
        for branch in paths:
            runner.rollback(len(ARCH_PROMPT))
            chain = runner.forward(torch.tensor([5] + branch)).logits
            rows, node = [], -1
            for token in branch:
                node = next(i for i in range(len(tree)) if int(tree.parents[i]) == node and int(tree.tokens[i]) == token)
                rows.append(1 + node)
            assert torch.equal(tree_logits[rows], chain[1:]), branch


@pytest.mark.parametrize("name", ["llama3", "mistral"])
def test_the_engine_reads_no_slot_its_rows_do_not_see(arch_file, name):
    """The KV buffers are not zero-filled (``llama.KVLayer._allocate``): the engine's attention must
    read only the slots its rows see. Planted: NaN in every slot past those written, before a chain
    pass, a token-tree pass (past the sliding window on Mistral's) and a batched pass of two
    sequences; every logit equals an unpoisoned run's bit for bit (a NaN read once spreads)."""
    from tierspec.cached_model import BatchItem, batched_pass
    from tierspec.tree import TokenTree, tree_pass

    model = _engine_model(arch_file(name))
    tree = TokenTree.from_paths([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [11, 40], [60, 61, 62]])
    layout = tree_pass(torch.tensor([5]), tree)

    def poison(runner: CachedModel) -> None:
        for layer in runner.cache.layers:
            layer._keys[..., layer.length :, :] = float("nan")
            layer._values[..., layer.length :, :] = float("nan")

    def run(poisoned: bool) -> list[torch.Tensor]:
        runner, other = CachedModel(model), CachedModel(model)
        outs = []
        with torch.inference_mode():
            for each in (runner, other):
                each.reserve(len(ARCH_PROMPT) + 40)
                outs.append(each.forward(ARCH_PROMPT[:-3]).logits)
                if poisoned:
                    poison(each)
            outs.append(runner.forward(ARCH_PROMPT[-3:]).logits)
            if poisoned:
                poison(runner)
            outs.append(runner.forward(layout.tokens, offsets=layout.offsets, attends=layout.attends).logits)
            runner.rollback(len(ARCH_PROMPT))
            if poisoned:
                poison(runner)
            results = batched_pass(model, [BatchItem(runner, torch.tensor([5, 6])), BatchItem(other, ARCH_PROMPT[-3:])])
            outs += [result.logits for result in results]
        return outs

    clean, poisoned = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(clean, poisoned))
    assert not any(bool(out.isnan().any()) for out in poisoned)


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("name", FEATURE_FILES + ["planted"])
def test_every_paths_feature_layers_match_the_reference_path(arch_file, name, path):
    """Each path's norms (q/k heads included), attention (heads of 256, scaled and soft-capped) and
    exp against the plain-C reference's through the same layers: float32 logits within a few ulps of
    their scale, the same greedy tokens."""
    if name == "planted":
        model = _engine_model(arch_file("gemma3-d256"), attention_scale=PLANTED_SCALAR ** -0.5,
                              attention_softcap=PLANTED_CAP)
    else:
        model = _engine_model(arch_file(name))
    with torch.inference_mode():
        with kernels("portable"):
            reference = CachedModel(model).forward(ARCH_PROMPT).logits
        with kernels(path):
            got = CachedModel(model).forward(ARCH_PROMPT).logits
    assert (got - reference).abs().max() <= 1e-5 * reference.abs().max()
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("path", PATHS)
def test_a_planted_attention_scale_and_soft_cap_match_transformers(arch_file, path, monkeypatch):
    """Gemma 3 (heads of 256) with query_pre_attn_scalar 24 and scores soft-capped at 3 against
    transformers' Gemma 3 configured so, its eager attention given the config's cap (transformers'
    soft-capping code; its Gemma 3 forward keeps attn_logit_softcapping but does not pass it on):
    within float32 rounding and the same greedy tokens, where the unplanted model is far off."""
    from transformers.models.gemma3 import modeling_gemma3

    eager = modeling_gemma3.eager_attention_forward
    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", lambda module, *args, **kwargs: eager(
        module, *args, **{**kwargs, "softcap": module.config.attn_logit_softcapping}))
    tiny = arch_file("gemma3-d256")
    planted = _engine_model(tiny, attention_scale=PLANTED_SCALAR ** -0.5, attention_softcap=PLANTED_CAP)
    reference = tiny.reference(query_pre_attn_scalar=PLANTED_SCALAR, attn_logit_softcapping=PLANTED_CAP)
    with torch.inference_mode():
        with kernels(path):
            ours = CachedModel(planted).forward(ARCH_PROMPT).logits
            plain = CachedModel(_engine_model(tiny)).forward(ARCH_PROMPT).logits
        theirs = reference(ARCH_PROMPT[None]).logits[0]
        uncapped = tiny.reference(query_pre_attn_scalar=PLANTED_SCALAR)(ARCH_PROMPT[None]).logits[0]
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() <= 1e-5 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert (plain - theirs).abs().max() > 1e-2 * scale  # the planted features change the logits
    assert (uncapped - theirs).abs().max() > 1e-3 * scale  # the cap among them


def test_the_gelu_tanh_gate_is_the_same_on_every_path_and_within_an_ulp_of_float64():
    """gelu_tanh(g) * u (tanh from each path's exp: the same bits everywhere) over ±12, random values,
    the polynomial's edge (|t| = 0.625), zeros and huge inputs: every path's bits equal the portable
    path's, each value within 2 float32 ulps of |g| of the float64 formula (torch's own float32 gelu:
    0.9; the formula's 1 + tanh cancels for negative g, so an ulp of g, not of the result)."""
    g = torch.cat([torch.linspace(-12, 12, 48001), torch.randn(16000, generator=torch.Generator().manual_seed(3)) * 3,
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.6115, -0.6115, 50.0, -50.0, 1e4, -1e4])])
    u = torch.randn(g.numel(), generator=torch.Generator().manual_seed(4))
    gate_up = torch.cat([g, u]).contiguous()
    results = {}
    for path in PATHS:
        with kernels(path):
            out = torch.empty(g.numel())
            qe.activate(activation="gelu_tanh", gate_up=gate_up.data_ptr(), rows=1, inter=g.numel(), out=out.data_ptr())
        results[path] = out
    assert all(torch.equal(out, results["portable"]) for out in results.values())
    exact = torch.nn.functional.gelu(g.double(), approximate="tanh") * u.double()
    error = (results["portable"].double() - exact).abs()
    assert (error <= 2 * 2 ** -23 * (g.double() * u.double()).abs() + 1e-37).all()
    with pytest.raises(ValueError, match="activation relu is not one the engine computes"):
        qe.activate(activation="relu", gate_up=gate_up.data_ptr(), rows=1, inter=4, out=gate_up.data_ptr())


def test_a_window_needs_a_trees_positions_and_is_refused_over_every_slot(arch_file):
    model = _engine_model(arch_file("mistral"))
    stack, first = model.model.engine_stack.capsule, model.model.layers[0].fused
    hidden, cos = torch.zeros(2, 256), torch.ones(2, 64)
    cache = model.new_kv_cache()
    table = cache.engine_table(2, first.kv_heads, first.head_dim)
    before = cache.layers[0]._keys.clone()  # as the allocator gave it (not zero-filled)
    tree = torch.tensor([[1, 0], [1, 1]], dtype=torch.uint8)
    with pytest.raises(ValueError, match="layer 0's sliding window needs a tree's positions .sequence 0 has none."):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 2, 0, table, tree)], [(cos, cos)],
                         bytes([3, 3, 3]))
    with pytest.raises(ValueError, match="layer 0 has a sliding window, which a mask over every slot does not define"):
        engine.run_stack(stack, hidden, torch.empty_like(hidden), [engine.Segment(0, 2, 0, table, tree, True)],
                         [(cos, cos)], bytes([3, 3, 3]))
    assert torch.equal(cache.layers[0]._keys.view(torch.int32), before.view(torch.int32))  # nothing ran (bit for bit)


def test_a_layers_features_are_checked_when_it_is_made(arch_file):
    layer = _engine_model(arch_file("qwen3")).model.layers[0]
    parts = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    qkv, o, gate_up, down = (part.qweight.handle for part in parts)
    norm = torch.ones(256).numpy()
    shapes = dict(qkv=qkv, o=o, gate_up=gate_up, down=down, norm_in=norm, norm_post=norm, eps=1e-6, hidden=256, heads=4,
                  kv_heads=2, head_dim=64, inter=512)
    for bad, message in (({"rotary_dims": 65}, "rotary dimensions 65 for heads of 64"),
                         ({"window": -1}, "a sliding window of -1 positions"),
                         ({"attention_scale": 0.0}, "an attention scale of 0"),
                         ({"softcap": float("inf")}, "an attention soft-cap of inf"),
                         ({"activation": "gelu"}, "activation gelu is not one the engine computes"),
                         ({"q_norm": torch.ones(64).numpy()}, "normalises both q and k heads or neither"),
                         ({"qkv_bias": torch.ones(100).numpy()}, "qkv_bias holds 400 bytes, not 512 float32 values"),
                         ({"rotary_table": 4}, "rotary table 4 is not one of 0..3")):
        with pytest.raises(ValueError, match=message):
            qe.make_layer(**shapes, **bad)
    with pytest.raises(TypeError):
        qe.make_layer(*shapes.values(), None)  # the features are keyword-only
