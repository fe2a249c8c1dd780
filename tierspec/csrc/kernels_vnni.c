/* The AVX512-VNNI path: 8-bit rows (LAYOUT_INT8) by vpdpbusd, 16 int32 lanes = the tile's rows, each
 * instruction adding four k's products of unsigned 8-bit weights (a Q4 or Q4_K nibble 0..15, a Q5_K
 * value 0..31, a Q6_K u = q + 32 in 0..63, or a Q8 value + 128) with the row's signed 8-bit values.
 * Per block: the exact int32 dot (a Q8 block's less 128 * the row's sum; Q6_K's per half, less 32 *
 * the half's sum), then acc += dot * (d * s) (+ mn * (s * sum) for the kinds with a minimum), in
 * float32: the reference's steps (kernels_ref.c), so the same bits. It needs AVX512-VNNI alone (no AVX512-BF16): Intel's
 * Ice Lake and this project's VM Xeon have the one without the other. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>

#include "avx512_blocks.h"

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define VNNI_ROWS 8

/* ``kind`` and ``mt`` are constants in each copy. Per block two chains of vpdpbusd per row: even and
 * odd quads of k, or for Q6_K the block's two halves (quads 0-3 and 4-7, each with its own scale),
 * whose dot products are then taken less 32 times the half's 8-bit sum (its values are stored as
 * u = q + 32). */
VNNI_TARGET static KERNEL_INLINE void tile_int8_vnni_rows(const matmul_args *a, int t, int m0, const int mt, const int kind) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const int32_t *x = (const int32_t *)a->x; /* quads of int8 */
    int K4 = w->K / 4;
    __m512 acc[VNNI_ROWS];
    __m512i c0[VNNI_ROWS], c1[VNNI_ROWS]; /* two chains of dot products per row */
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind);
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
        const int32_t *xb = x + (size_t)m0 * K4 + b * (QK / 4);
        for (int i = 0; i < mt; i++) c0[i] = c1[i] = _mm512_setzero_si512();
        __m512 d[2], mn = _mm512_setzero_ps();
        avx512_block_scales(kind, cell, j, d, &mn);
        switch (kind) {
        case KIND_Q8: {
            const uint8_t *q = ((const cell_q8 *)cell)->q;
            for (int g = 0; g < 8; g += 2) { /* quads g, g + 1: 64 bytes each */
                __m512i w0 = _mm512_loadu_si512((const void *)(q + 64 * g));
                __m512i w1 = _mm512_loadu_si512((const void *)(q + 64 * g + 64));
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4 + g;
                    c0[i] = _mm512_dpbusd_epi32(c0[i], w0, _mm512_set1_epi32(xr[0]));
                    c1[i] = _mm512_dpbusd_epi32(c1[i], w1, _mm512_set1_epi32(xr[1]));
                }
            }
            for (int i = 0; i < mt; i++)
                acc[i] = avx512_int8_scaled(kind, acc[i], _mm512_add_epi32(c0[i], c1[i]), c1[i], d, mn, a, (size_t)(m0 + i) * KB + b, NULL);
            break;
        }
        case KIND_Q4: case KIND_Q4K: case KIND_Q5K: case KIND_Q6K: {
            const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
            const int bits = high_bits(kind), halves = kind == KIND_Q6K;
            for (int g = 0; g < 4; g++) {
                /* chain 0 takes quad g0, chain 1 quad g1: even and odd quads, or Q6_K's halves */
                int g0 = halves ? g : 2 * g, g1 = halves ? g + 4 : 2 * g + 1;
                /* 32 bytes per quad: values 0..31 in the low nibbles, 32..63 in the high */
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(q + 32 * g0));
                __m256i r1 = _mm256_loadu_si256((const __m256i *)(q + 32 * g1));
                __m512i w0 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r0), _mm256_srli_epi16(r0, 4), 1), low);
                __m512i w1 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r1), _mm256_srli_epi16(r1, 4), 1), low);
                w0 = avx512_int8_high(bits, hi, g0, w0);
                w1 = avx512_int8_high(bits, hi, g1, w1);
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4;
                    c0[i] = _mm512_dpbusd_epi32(c0[i], w0, _mm512_set1_epi32(xr[g0]));
                    c1[i] = _mm512_dpbusd_epi32(c1[i], w1, _mm512_set1_epi32(xr[g1]));
                }
            }
            for (int i = 0; i < mt; i++) /* Q6_K: its halves' chains apart; otherwise the two chains summed */
                acc[i] = avx512_int8_scaled(kind, acc[i], halves ? c0[i] : _mm512_add_epi32(c0[i], c1[i]), c1[i], d, mn, a,
                                            (size_t)(m0 + i) * KB + b, halves ? a->half_isums + (size_t)(m0 + i) * (2 * KB) + 2 * b : NULL);
            break;
        }
        default: UNKNOWN_KIND();
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}

#define VNNI_KIND(kind)                                                                                        \
    VNNI_TARGET static void tile_int8_vnni_##kind(const matmul_args *a, int t, int m0, int mt) {               \
        switch (mt) {                                                                                          \
        case 1: tile_int8_vnni_rows(a, t, m0, 1, kind); break;                                                 \
        case 2: tile_int8_vnni_rows(a, t, m0, 2, kind); break;                                                 \
        case 3: tile_int8_vnni_rows(a, t, m0, 3, kind); break;                                                 \
        case 4: tile_int8_vnni_rows(a, t, m0, 4, kind); break;                                                 \
        case 5: tile_int8_vnni_rows(a, t, m0, 5, kind); break;                                                 \
        case 6: tile_int8_vnni_rows(a, t, m0, 6, kind); break;                                                 \
        case 7: tile_int8_vnni_rows(a, t, m0, 7, kind); break;                                                 \
        default: tile_int8_vnni_rows(a, t, m0, 8, kind); break;                                                \
        }                                                                                                      \
    }
VNNI_KIND(KIND_Q4)
VNNI_KIND(KIND_Q8)
VNNI_KIND(KIND_Q4K)
VNNI_KIND(KIND_Q5K)
VNNI_KIND(KIND_Q6K)

/* The int8 kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn tile_int8_vnni(int kind) {
    switch (kind) {
    case KIND_Q4: return tile_int8_vnni_KIND_Q4;
    case KIND_Q8: return tile_int8_vnni_KIND_Q8;
    case KIND_Q4K: return tile_int8_vnni_KIND_Q4K;
    case KIND_Q5K: return tile_int8_vnni_KIND_Q5K;
    case KIND_Q6K: return tile_int8_vnni_KIND_Q6K;
    default: UNKNOWN_KIND();
    }
}

void install_vnni(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_INT8][kind] = (tile_kernel){tile_int8_vnni(kind), VNNI_ROWS, ISA_AVX512VNNI};
}

#else
void install_vnni(kernel_set *k) { (void)k; }
#endif
