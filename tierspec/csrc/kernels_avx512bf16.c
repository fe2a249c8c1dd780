/* The AVX512-BF16 path: bfloat16 rows (LAYOUT_BF16) by vdpbf16ps, 16 float lanes = the tile's rows,
 * each instruction adding two k's products; and the bfloat16 row preparation. Its sums run in its own
 * order (pairs of k, two chains per block), so it matches the reference within rounding, not bitwise. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#define BF16_ROWS 8

BF16_TARGET static void prepare_bf16_avx512(const float *x, int M, int K, uint16_t *xbuf, float *sums) {
    int KB = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
            _mm512_storeu_si512((void *)(xbuf + (size_t)m * K + b * QK), (__m512i)h);
            __m512i bits = (__m512i)h; /* bfloat16 -> float32: the 16 bits on top */
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
            sums[(size_t)m * KB + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

/* Per block the sum of q_k x_k (bfloat16 products, float32 sums), then acc += d * it + m * sum x. */
BF16_TARGET static inline void tile_bf16_rows(const matmul_args *a, int t, int m0, const int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const uint32_t *x = (const uint32_t *)a->x; /* bfloat16 pairs */
    int K2 = w->K / 2;
    /* per row and block two running sums (even and odd pairs of k), added at the block's end: twice
     * the independent vdpbf16ps chains, whose latency bounds a product over few rows otherwise */
    __m512 acc[BF16_ROWS], even[BF16_ROWS], odd[BF16_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f);
    size_t cb = cell_bytes(w->kind);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = cell_at(w, t, b);
        /* the cells a few blocks ahead (the next tile's first ones at a tile's end): a pass over
         * several rows computes long enough per cell that the loads must be asked for early */
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
        const uint32_t *xb = x + (size_t)m0 * K2 + b * (QK / 2);
        for (int i = 0; i < mt; i++) even[i] = odd[i] = _mm512_setzero_ps();
        if (w->kind == KIND_Q4) {
            /* A nibble q OR-ed into 0x4300 is the bfloat16 of 128 + q (exact): one instruction where a
             * table lookup took one on the shuffle unit. So the block's dot product is of (128 + q),
             * and w = d*q + m = d*(128 + q) + (m - 128 d) takes the offset into the minimum's term. */
            const uint8_t *q = ((const cell_q4 *)cell)->q;
            const __m512i bias = _mm512_set1_epi16(0x4300);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(raw, low, bias, 0xEA); /* (raw & low) | bias */
                __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 4), bias);
                for (int i = 0; i < mt; i++) {
                    const uint32_t *xr = xb + (size_t)i * K2 + 2 * g;
                    even[i] = _mm512_dpbf16_ps(even[i], w0, (__m512bh)_mm512_set1_epi32((int)xr[0]));
                    odd[i] = _mm512_dpbf16_ps(odd[i], w1, (__m512bh)_mm512_set1_epi32((int)xr[1]));
                }
            }
            __m512 mn = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0f),
                                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32))));
            for (int i = 0; i < mt; i++) {
                acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d, acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
        } else {
            const uint8_t *q = ((const cell_q8 *)cell)->q;
            for (int p = 0; p < 16; p++) {
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p))));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16))));
                __m512bh wp = _mm512_cvtne2ps_pbh(hi, lo);
                if (p & 1)
                    for (int i = 0; i < mt; i++)
                        odd[i] = _mm512_dpbf16_ps(odd[i], wp, (__m512bh)_mm512_set1_epi32((int)xb[(size_t)i * K2 + p]));
                else
                    for (int i = 0; i < mt; i++)
                        even[i] = _mm512_dpbf16_ps(even[i], wp, (__m512bh)_mm512_set1_epi32((int)xb[(size_t)i * K2 + p]));
            }
            for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d, acc[i]);
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}

BF16_TARGET static void tile_bf16(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_bf16_rows(a, t, m0, 1); break;
    case 2: tile_bf16_rows(a, t, m0, 2); break;
    case 3: tile_bf16_rows(a, t, m0, 3); break;
    case 4: tile_bf16_rows(a, t, m0, 4); break;
    case 5: tile_bf16_rows(a, t, m0, 5); break;
    case 6: tile_bf16_rows(a, t, m0, 6); break;
    case 7: tile_bf16_rows(a, t, m0, 7); break;
    default: tile_bf16_rows(a, t, m0, 8); break;
    }
}

void install_avx512bf16(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_BF16][kind] = (tile_kernel){tile_bf16, BF16_ROWS, ISA_AVX512BF16};
    k->prepare_bf16 = prepare_bf16_avx512;
    k->isa[OP_PREPARE_BF16] = ISA_AVX512BF16;
}

#else
void install_avx512bf16(kernel_set *k) { (void)k; }
#endif
