/* The first of a float row's largest entries, on AVX2 and AVX-512: the pass engine's product maxima
 * (kernels_avx2.c, kernels_avx512.c: each thread's ``first_max`` over the columns it has just computed),
 * the keyed-noise extension's first maxima (noise/keyed_noise.c) and the start of the perturbed argmax
 * both draw with (keyed_scan.h) read rows alike, so one copy serves all. The value first (vmaxps over the
 * lanes, which keeps its second operand where either is a NaN — a NaN is reported by its own test), then
 * the first index holding it: the index an argmax over the row gives, the first of equal maxima.
 * Header-only, each function under its own target attribute, so every includer calls it from code built
 * for that instruction set or more. */
#ifndef TIERSPEC_ROW_TOP_H
#define TIERSPEC_ROW_TOP_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define ROW_TOP_AVX2 __attribute__((target("avx2")))
#define ROW_TOP_AVX512 __attribute__((target("avx512f,avx512dq,avx512vl")))

/* The first index of the row's largest entry and that entry in *top; -1 where the row holds a NaN (*top
 * then unset). vocab >= 1. */
ROW_TOP_AVX2 static inline int64_t row_top_avx2(const float *x, int64_t vocab, float *top) {
    __m256 top8 = _mm256_set1_ps(-INFINITY), nan8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= vocab; j += 8) {
        __m256 v = _mm256_loadu_ps(x + j);
        nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        top8 = _mm256_max_ps(top8, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top8);
    float top_x = -INFINITY;
    for (int i = 0; i < 8; i++) top_x = lanes[i] > top_x ? lanes[i] : top_x;
    if (_mm256_movemask_ps(nan8)) return -1;
    for (; j < vocab; j++) {
        if (x[j] != x[j]) return -1;
        top_x = x[j] > top_x ? x[j] : top_x;
    }
    *top = top_x;
    const __m256 wanted = _mm256_set1_ps(top_x);
    for (j = 0; j + 8 <= vocab; j += 8) {
        int equal = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), wanted, _CMP_EQ_OQ));
        if (equal) return j + __builtin_ctz((unsigned)equal);
    }
    for (; j < vocab; j++)
        if (x[j] == top_x) return j;
    return 0; /* not reached: top_x is one of the row's entries */
}

/* The row's largest entry, and in *nan whether it holds a NaN. */
ROW_TOP_AVX512 static inline float row_max_avx512(const float *x, int64_t vocab, int *nan) {
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    int64_t j = 0;
    for (; j + 16 <= vocab; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        top16 = _mm512_max_ps(top16, v);
    }
    float top_x = _mm512_reduce_max_ps(top16);
    *nan = unordered != 0;
    for (; j < vocab; j++) {
        *nan |= x[j] != x[j];
        top_x = x[j] > top_x ? x[j] : top_x;
    }
    return top_x;
}

/* ``row_top_avx2``'s answer, 16 lanes at a time. */
ROW_TOP_AVX512 static inline int64_t row_top_avx512(const float *x, int64_t vocab, float *top) {
    int nan;
    float top_x = row_max_avx512(x, vocab, &nan);
    if (nan) return -1;
    *top = top_x;
    const __m512 wanted = _mm512_set1_ps(top_x);
    int64_t j = 0;
    for (; j + 16 <= vocab; j += 16) {
        __mmask16 equal = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), wanted, _CMP_EQ_OQ);
        if (equal) return j + __builtin_ctz((unsigned)equal);
    }
    for (; j < vocab; j++)
        if (x[j] == top_x) return j;
    return 0; /* not reached: top_x is one of the row's entries */
}

#endif
