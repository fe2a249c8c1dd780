/* The AVX512-BF16 path: bfloat16 rows (LAYOUT_BF16) by vdpbf16ps, 16 float lanes = the tile's rows,
 * each instruction adding two k's products; and the bfloat16 row preparation. Its sums run in its own
 * order (pairs of k, two chains per block), so it matches the reference within rounding, not bitwise. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>

#include "avx512_blocks.h"

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

/* Per block the sum of v_k x_k (bfloat16 products, float32 sums), then acc += d * it + mn * sum x.
 * ``kind`` and ``mt`` are constants in each copy. */
BF16_TARGET static KERNEL_INLINE void tile_bf16_rows(const matmul_args *a, int t, int m0, const int mt, const int kind) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const uint32_t *x = (const uint32_t *)a->x; /* bfloat16 pairs */
    int K2 = w->K / 2;
    /* per row and block two running sums (even and odd pairs of k, or Q6_K's two halves), added at
     * the block's end: twice the independent vdpbf16ps chains, whose latency bounds a product over
     * few rows otherwise */
    __m512 acc[BF16_ROWS], even[BF16_ROWS], odd[BF16_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f);
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind);
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        /* the cells a few blocks ahead (the next tile's first ones at a tile's end): a pass over
         * several rows computes long enough per cell that the loads must be asked for early */
        const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
        __m512 d[2], mn = _mm512_setzero_ps();
        avx512_block_scales(kind, cell, j, d, &mn);
        const uint32_t *xb = x + (size_t)m0 * K2 + b * (QK / 2);
        for (int i = 0; i < mt; i++) even[i] = odd[i] = _mm512_setzero_ps();
        switch (kind) {
        case KIND_Q4: case KIND_Q4K: case KIND_Q5K: {
            /* A value u < 128 OR-ed into 0x4300 is the bfloat16 of 128 + u (exact): one instruction where
             * a table lookup took one on the shuffle unit. So the block's dot product is of (128 + u),
             * and w = d*u + mn = d*(128 + u) + (mn - 128 d) takes the offset into the minimum's term. */
            const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
            const int bits = high_bits(kind);
            const __m512i bias = _mm512_set1_epi16(0x4300);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                __m512i u0 = avx512_bf16_high(bits, hi, 2 * g, _mm512_and_si512(raw, low));
                __m512i u1 = avx512_bf16_high(bits, hi, 2 * g + 1, _mm512_srli_epi16(raw, 4));
                __m512bh w0 = (__m512bh)_mm512_or_si512(u0, bias);
                __m512bh w1 = (__m512bh)_mm512_or_si512(u1, bias);
                for (int i = 0; i < mt; i++) {
                    const uint32_t *xr = xb + (size_t)i * K2 + 2 * g;
                    even[i] = _mm512_dpbf16_ps(even[i], w0, (__m512bh)_mm512_set1_epi32((int)xr[0]));
                    odd[i] = _mm512_dpbf16_ps(odd[i], w1, (__m512bh)_mm512_set1_epi32((int)xr[1]));
                }
            }
            __m512 shifted = _mm512_fmadd_ps(d[0], _mm512_set1_ps(-128.0f), mn);
            for (int i = 0; i < mt; i++) {
                acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d[0], acc[i]);
                acc[i] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
            break;
        }
        case KIND_Q6K: { /* q = u - 32 as bfloat16 (exact), pairs 0-7 (the first half) and 8-15 apart */
            const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                for (int e = 0; e < 2; e++) { /* pair 2g + e */
                    int p = 2 * g + e;
                    __m512i u = avx512_bf16_high(2, hi, p, e ? _mm512_srli_epi16(raw, 4) : _mm512_and_si512(raw, low));
                    u = _mm512_sub_epi16(u, _mm512_set1_epi16(32));
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(u)));
                    __m512 up = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(u, 1)));
                    __m512bh wp = _mm512_cvtne2ps_pbh(up, lo);
                    for (int i = 0; i < mt; i++) {
                        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[(size_t)i * K2 + p]);
                        if (p < 8) even[i] = _mm512_dpbf16_ps(even[i], wp, xv);
                        else odd[i] = _mm512_dpbf16_ps(odd[i], wp, xv);
                    }
                }
            }
            for (int i = 0; i < mt; i++) {
                acc[i] = _mm512_fmadd_ps(even[i], d[0], acc[i]);
                acc[i] = _mm512_fmadd_ps(odd[i], d[1], acc[i]);
            }
            break;
        }
        case KIND_Q8: {
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
            for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d[0], acc[i]);
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

#define BF16_KIND(kind)                                                                                        \
    BF16_TARGET static void tile_bf16_##kind(const matmul_args *a, int t, int m0, int mt) {                    \
        switch (mt) {                                                                                          \
        case 1: tile_bf16_rows(a, t, m0, 1, kind); break;                                                      \
        case 2: tile_bf16_rows(a, t, m0, 2, kind); break;                                                      \
        case 3: tile_bf16_rows(a, t, m0, 3, kind); break;                                                      \
        case 4: tile_bf16_rows(a, t, m0, 4, kind); break;                                                      \
        case 5: tile_bf16_rows(a, t, m0, 5, kind); break;                                                      \
        case 6: tile_bf16_rows(a, t, m0, 6, kind); break;                                                      \
        case 7: tile_bf16_rows(a, t, m0, 7, kind); break;                                                      \
        default: tile_bf16_rows(a, t, m0, 8, kind); break;                                                     \
        }                                                                                                      \
    }
BF16_KIND(KIND_Q4)
BF16_KIND(KIND_Q8)
BF16_KIND(KIND_Q4K)
BF16_KIND(KIND_Q5K)
BF16_KIND(KIND_Q6K)

/* The bfloat16 kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn tile_bf16(int kind) {
    switch (kind) {
    case KIND_Q4: return tile_bf16_KIND_Q4;
    case KIND_Q8: return tile_bf16_KIND_Q8;
    case KIND_Q4K: return tile_bf16_KIND_Q4K;
    case KIND_Q5K: return tile_bf16_KIND_Q5K;
    case KIND_Q6K: return tile_bf16_KIND_Q6K;
    default: UNKNOWN_KIND();
    }
}

void install_avx512bf16(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_BF16][kind] = (tile_kernel){tile_bf16(kind), BF16_ROWS, ISA_AVX512BF16};
    k->prepare_bf16 = prepare_bf16_avx512;
    k->isa[OP_PREPARE_BF16] = ISA_AVX512BF16;
}

#else
void install_avx512bf16(kernel_set *k) { (void)k; }
#endif
