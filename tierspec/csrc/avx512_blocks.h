/* What every AVX-512 kernel file (kernels_avx512.c, kernels_vnni.c, kernels_avx512bf16.c,
 * kernels_amx.c) reads of a cell the same way: a block's scales for a tile's 16 rows. Compiled for
 * the AVX-512 base (F/BW/VL/DQ); each includer's own target is a superset, so these inline there. */
#ifndef TIERSPEC_AVX512_BLOCKS_H
#define TIERSPEC_AVX512_BLOCKS_H

#include <immintrin.h>

#include "blocks.h"

#define AVX512_BASE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

/* A block's scales for a tile's 16 output rows as float32 (blocks.h's block_scales, 16 lanes): d[h]
 * multiplies inputs 16h .. 16h + 15 (d[0] = d[1] but for Q6_K), *mn the term per unit of the block's
 * input sum (the kinds with a minimum; left alone otherwise). Sub-block j of a K-quant cell:
 * D = d*sc and mn = -(dmin*m), exact. */
AVX512_BASE_TARGET static KERNEL_INLINE void avx512_block_scales(const int kind, const uint8_t *cell, int j, __m512 d[2], __m512 *mn) {
    switch (kind) {
    case KIND_Q4:
        d[0] = d[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const cell_q4 *)cell)->d));
        *mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const cell_q4 *)cell)->m));
        return;
    case KIND_Q8:
        d[0] = d[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const cell_q8 *)cell)->d));
        return;
    case KIND_Q4K: case KIND_Q5K: { /* the two cells share these fields' places */
        const cell_q4k *c = (const cell_q4k *)cell;
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c->sc[j])));
        __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c->mn[j])));
        d[0] = d[1] = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d)), sc);
        *mn = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(
                  _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->dmin)), m)), _mm512_set1_epi32((int)0x80000000)));
        return;
    }
    case KIND_Q6K: {
        const cell_q6k *c = (const cell_q6k *)cell;
        __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)c->d));
        for (int h = 0; h < 2; h++)
            d[h] = _mm512_mul_ps(dd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c->sc[2 * j + h]))));
        return;
    }
    default: UNKNOWN_KIND();
    }
}

/* LAYOUT_INT8: quad g's 64 stored values (position 4r + k%4) with their high bits from the plane
 * (hi_slot: a 64-bit mask per bit), ``nib`` holding the low four bits. */
AVX512_BASE_TARGET static KERNEL_INLINE __m512i avx512_int8_high(const int bits, const uint8_t *hi, int g, __m512i nib) {
    for (int b = 0; b < bits; b++) {
        uint64_t mask;
        memcpy(&mask, hi + 8 * (bits * g + b), 8);
        nib = _mm512_mask_add_epi8(nib, (__mmask64)mask, nib, _mm512_set1_epi8((char)(16 << b)));
    }
    return nib;
}

/* LAYOUT_BF16: pair p's 32 stored values as 16-bit words (position 2r + k%2) with their high bits
 * from the plane (hi_slot: a 32-bit mask per bit), ``nib`` holding the low four bits. */
AVX512_BASE_TARGET static KERNEL_INLINE __m512i avx512_bf16_high(const int bits, const uint8_t *hi, int p, __m512i nib) {
    for (int b = 0; b < bits; b++) {
        uint32_t mask;
        memcpy(&mask, hi + 4 * (bits * p + b), 4);
        nib = _mm512_mask_add_epi16(nib, (__mmask32)mask, nib, _mm512_set1_epi16((short)(16 << b)));
    }
    return nib;
}

/* One row's int8 block scaled into its 16 running sums: the float steps every 8-bit kernel takes
 * after its exact int32 dot products (the reference's, kernels_ref.c; kernels_vnni.c and the AMX tiles
 * share this, so their bits are one another's by construction). ``dot`` is the block's dot product,
 * or for Q6_K its first half's and ``up`` its second's; at ``row`` (the row's and block's index into
 * the product's arrays, matmul_args): s its block scale, isum its 8-bit sum, offset = s * (float)isum
 * (made once a product, where each tile of 16 outputs converted, multiplied and broadcast it again: the
 * default model's 3,072 x 576 product over 16 rows 84 -> 80 us on a Xeon), half its Q6_K half sums
 * (read only for Q6_K).
 *   Q4, Q4_K, Q5_K: acc += dot * (d * s), then acc += mn * (s * isum)
 *   Q6_K:           acc += (dot - 32 half0) * (d0 * s), then acc += (up - 32 half1) * (d1 * s)
 *   Q8:             acc += (dot - 128 isum) * (d * s) */
AVX512_BASE_TARGET static KERNEL_INLINE __m512 avx512_int8_scaled(const int kind, __m512 acc, __m512i dot, __m512i up, const __m512 d[2],
                                                                  __m512 mn, const matmul_args *a, size_t row, const int32_t *half) {
    const float s = a->sums[row];
    const int32_t isum = a->isums[row];
    switch (kind) {
    case KIND_Q4: case KIND_Q4K: case KIND_Q5K:
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[0], _mm512_set1_ps(s)), acc);
        return _mm512_fmadd_ps(mn, _mm512_set1_ps(a->offsets[row]), acc);
    case KIND_Q6K: {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_set1_epi32(32 * half[0])));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(up, _mm512_set1_epi32(32 * half[1])));
        acc = _mm512_fmadd_ps(lo, _mm512_mul_ps(d[0], _mm512_set1_ps(s)), acc);
        return _mm512_fmadd_ps(hi, _mm512_mul_ps(d[1], _mm512_set1_ps(s)), acc);
    }
    case KIND_Q8:
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot, _mm512_set1_epi32(128 * isum))), _mm512_mul_ps(d[0], _mm512_set1_ps(s)),
                               acc);
    default: UNKNOWN_KIND();
    }
}

#endif
