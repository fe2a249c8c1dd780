/* The AVX512-VNNI path: 8-bit rows (LAYOUT_INT8) by vpdpbusd, 16 int32 lanes = the tile's rows, each
 * instruction adding four k's products of unsigned 8-bit weights (a Q4 nibble 0..15, or a Q8 value
 * + 128) with the row's signed 8-bit values. Per block: the exact int32 dot (a Q8 block's less 128 *
 * the row's sum), then acc += dot * (d * s) (+ m * (s * sum) for Q4), in float32: the reference's
 * steps (kernels_ref.c), so the same bits. It needs AVX512-VNNI alone (no AVX512-BF16): Intel's
 * Ice Lake and this project's VM Xeon have the one without the other. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define VNNI_ROWS 8

VNNI_TARGET static inline void tile_int8_vnni_rows(const matmul_args *a, int t, int m0, const int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const int32_t *x = (const int32_t *)a->x; /* quads of int8 */
    int K4 = w->K / 4;
    __m512 acc[VNNI_ROWS];
    __m512i even[VNNI_ROWS], odd[VNNI_ROWS]; /* two chains of dot products per row */
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    size_t cb = cell_bytes(w->kind);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = cell_at(w, t, b);
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        const int32_t *xb = x + (size_t)m0 * K4 + b * (QK / 4);
        for (int i = 0; i < mt; i++) even[i] = odd[i] = _mm512_setzero_si512();
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
        if (w->kind == KIND_Q4) {
            const uint8_t *q = ((const cell_q4 *)cell)->q;
            for (int g = 0; g < 8; g += 2) { /* quads g, g + 1: 32 bytes each (64 nibbles: 16 rows x 4 k) */
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
                __m256i r1 = _mm256_loadu_si256((const __m256i *)(q + 32 * g + 32));
                __m512i w0 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r0), _mm256_srli_epi16(r0, 4), 1), low);
                __m512i w1 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r1), _mm256_srli_epi16(r1, 4), 1), low);
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4 + g;
                    even[i] = _mm512_dpbusd_epi32(even[i], w0, _mm512_set1_epi32(xr[0]));
                    odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(xr[1]));
                }
            }
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32)));
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[i], odd[i]));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s * (float)a->isums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
        } else {
            const uint8_t *q = ((const cell_q8 *)cell)->q;
            for (int g = 0; g < 8; g += 2) { /* quads g, g + 1: 64 bytes each */
                __m512i w0 = _mm512_loadu_si512((const void *)(q + 64 * g));
                __m512i w1 = _mm512_loadu_si512((const void *)(q + 64 * g + 64));
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4 + g;
                    even[i] = _mm512_dpbusd_epi32(even[i], w0, _mm512_set1_epi32(xr[0]));
                    odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(xr[1]));
                }
            }
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512i offset = _mm512_set1_epi32(128 * a->isums[(size_t)(m0 + i) * KB + b]);
                __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even[i], odd[i]), offset));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
            }
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}

VNNI_TARGET static void tile_int8_vnni(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_int8_vnni_rows(a, t, m0, 1); break;
    case 2: tile_int8_vnni_rows(a, t, m0, 2); break;
    case 3: tile_int8_vnni_rows(a, t, m0, 3); break;
    case 4: tile_int8_vnni_rows(a, t, m0, 4); break;
    case 5: tile_int8_vnni_rows(a, t, m0, 5); break;
    case 6: tile_int8_vnni_rows(a, t, m0, 6); break;
    case 7: tile_int8_vnni_rows(a, t, m0, 7); break;
    default: tile_int8_vnni_rows(a, t, m0, 8); break;
    }
}

void install_vnni(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_INT8][kind] = (tile_kernel){tile_int8_vnni, VNNI_ROWS, ISA_AVX512VNNI};
}

#else
void install_vnni(kernel_set *k) { (void)k; }
#endif
