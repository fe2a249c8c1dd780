/* The AVX2 path (AVX2 + FMA + F16C): float32 rows (LAYOUT_F32) in 8 lanes, 8-bit rows (LAYOUT_INT8)
 * by vpmaddubsw + vpmaddwd, the row preparation for both, exp, the RMS norm and attention. Its
 * products and rows take the reference's order and steps exactly (kernels_ref.c): the same bits. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* Rows as float32 (rounded to bfloat16 values when asked: round to nearest even at bit 16, as
 * float_to_bf16 does for finite values) and their block sums in the reference's 8-lane order. */
AVX2_TARGET static void prepare_f32_avx2(int round_bf16, const float *x, int M, int K, float *xbuf, float *sums) {
    int KB = K / QK;
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), top = _mm256_set1_epi32((int)0xffff0000);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            float *out = xbuf + (size_t)m * K + b * QK;
            __m256 lane = _mm256_setzero_ps();
            for (int i = 0; i < QK; i += 8) {
                __m256 r = _mm256_loadu_ps(v + i);
                if (round_bf16) {
                    __m256i bits = _mm256_castps_si256(r);
                    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
                    bits = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), top);
                    r = _mm256_castsi256_ps(bits);
                }
                _mm256_storeu_ps(out + i, r);
                lane = i ? _mm256_add_ps(lane, r) : r;
            }
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(lane), _mm256_extractf128_ps(lane, 1)); /* j + (j+4) */
            __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                   /* (0+2), (1+3) */
            sums[(size_t)m * KB + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
        }
}

/* LAYOUT_F32 in the reference's order (four running sums per output, by k mod 4), 8 float lanes =
 * 8 output rows: the tile's two halves one after the other (4 sums x 3 rows x a half fill 12 of
 * the 16 registers), up to 3 rows of x at once. */
#define AVX2_ROWS 3
AVX2_TARGET static inline void tile_f32_avx2_rows(const matmul_args *a, int t, int m0, const int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const float *x = (const float *)a->x;
    const __m256i low = _mm256_set1_epi32(0x0f);
    size_t cb = cell_bytes(w->kind);
    float vals[AVX2_ROWS][TILE];
    for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 of the tile */
        __m256 p[AVX2_ROWS][4];
        for (int i = 0; i < mt; i++) p[i][0] = p[i][1] = p[i][2] = p[i][3] = _mm256_setzero_ps();
        for (int b = 0; b < KB; b++) {
            const uint8_t *cell = cell_at(w, t, b);
            if (h == 0)
                for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 16 * h)));
            const float *xb = x + (size_t)m0 * w->K + b * QK;
            for (int k = 0; k < QK; k += 4) {
                __m256 wk[4];
                if (w->kind == KIND_Q4) { /* 16 bytes per pair of k: row r's k low, k + 1 high */
                    const uint8_t *q = ((const cell_q4 *)cell)->q + 8 * k + 8 * h;
                    __m256i r01 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
                    __m256i r23 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16)));
                    wk[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(r01, low)));
                    wk[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(r01, 4)));
                    wk[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(r23, low)));
                    wk[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(r23, 4)));
                } else { /* 16 bytes per k: rows 0..15 */
                    const uint8_t *q = ((const cell_q8 *)cell)->q + 16 * k + 8 * h;
                    for (int j = 0; j < 4; j++)
                        wk[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * j)))));
                }
                for (int i = 0; i < mt; i++) {
                    const float *xr = xb + (size_t)i * w->K + k;
                    for (int j = 0; j < 4; j++) p[i][j] = _mm256_fmadd_ps(wk[j], _mm256_broadcast_ss(xr + j), p[i][j]);
                }
            }
            if (w->kind == KIND_Q4) {
                __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 32 + 16 * h)));
                for (int i = 0; i < mt; i++)
                    p[i][0] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), p[i][0]);
            }
        }
        for (int i = 0; i < mt; i++)
            _mm256_storeu_ps(vals[i] + 8 * h, _mm256_add_ps(_mm256_add_ps(p[i][0], p[i][1]), _mm256_add_ps(p[i][2], p[i][3])));
    }
    for (int i = 0; i < mt; i++) store_tile(a, m0 + i, t, vals[i]);
}

AVX2_TARGET static void tile_f32_avx2(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_f32_avx2_rows(a, t, m0, 1); break;
    case 2: tile_f32_avx2_rows(a, t, m0, 2); break;
    default: tile_f32_avx2_rows(a, t, m0, 3); break;
    }
}

/* LAYOUT_INT8's rows: prepare_int8_ref's steps (max, a correctly rounded division, rounding to
 * nearest even, clamping to +-127), 8 lanes at a time: the same bytes. */
AVX2_TARGET static void prepare_int8_avx2(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums) {
    int KB = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            __m256 a[4];
            for (int j = 0; j < 4; j++) a[j] = _mm256_loadu_ps(v + 8 * j);
            __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, a[0]), _mm256_andnot_ps(sign, a[1])),
                                       _mm256_max_ps(_mm256_andnot_ps(sign, a[2]), _mm256_andnot_ps(sign, a[3])));
            __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
            float amax = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4))); /* max is exact in any order */
            float scale = amax / 127.0f;
            __m256i q[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            if (scale > 0.0f) {
                __m256 sv = _mm256_set1_ps(scale);
                for (int j = 0; j < 4; j++)
                    q[j] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, _mm256_cvtps_epi32(_mm256_div_ps(a[j], sv))));
            }
            /* int32 -> int8 (every value in -127..127, so the saturating packs are exact); packs
             * interleave 128-bit halves, the permute puts the 32 bytes back in order */
            __m256i q16 = _mm256_packs_epi32(q[0], q[1]), q16b = _mm256_packs_epi32(q[2], q[3]);
            __m256i q8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(q16, q16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(xq + (size_t)m * K + b * QK), q8);
            __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            scales[(size_t)m * KB + b] = scale;
            isums[(size_t)m * KB + b] = _mm_cvtsi128_si32(s4);
        }
}

/* LAYOUT_INT8 products: per block, each output's exact int32 dot product of the weight's integers
 * with the row's 8-bit values, then the reference's float steps (acc += dot * (d * s), and for Q4
 * acc += m * (s * sum x8)): the same bits as the reference and the VNNI and AMX kernels, whatever
 * the row count. 8 int32 lanes = 8 output rows (a lane holds one output's quad of k): the tile's
 * two halves are two vectors, over up to INT8_ROWS rows of x, so each weight vector is loaded once
 * for all the rows and each row's quad broadcast once for both halves.
 *
 * vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16 with
 * saturation, so each kind keeps its pairs inside int16 (|x8| <= 127):
 *  - Q4: nibbles 0..15, a pair at most 2 * 15 * 127 = 3810, so the 8 quads of a block add up in
 *    int16 (8 * 3810 = 30480 < 32767) before one vpmaddwd widens them;
 *  - Q8: stored q + 128 (0..255) would reach 2 * 255 * 127 > 32767, so the kernel takes the signed q
 *    back (xor 128) and multiplies |q| (0..128, unsigned) by x8 with q's sign (vpsignb: -x8 is in
 *    range): a pair at most 2 * 128 * 127 = 32512, widened by vpmaddwd after each quad.
 * A new cell kind adds its dot helper and its case of float steps in tile_int8_avx2_rows. */
#define INT8_ROWS 4

/* Keeps a running integer sum in a register where the code adds to it: without it GCC reassociates
 * the (exact) integer additions into one tree at the end of the block, computing every product
 * first and spilling them to the stack. */
#define IN_ORDER(v) __asm__("" : "+x"(v))

/* A Q4 cell's block: dot[i][h] = sum_k q[k] * x8_i[k] for outputs 8h .. 8h + 7 (int32 lanes). */
AVX2_TARGET static inline void int8_dots_q4(const uint8_t *cell, const int32_t *xb, int K4, const int mt, __m256i dot[][2]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const uint8_t *q = ((const cell_q4 *)cell)->q;
    __m256i pairs[INT8_ROWS][2];
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; g++) { /* quad g: 32 bytes, rows 0..7 in the low nibbles, 8..15 in the high */
        __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
        __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int i = 0; i < mt; i++) {
            __m256i xq = _mm256_set1_epi32(xb[(size_t)i * K4 + g]);
            __m256i p0 = _mm256_maddubs_epi16(w0, xq), p1 = _mm256_maddubs_epi16(w1, xq);
            pairs[i][0] = g ? _mm256_add_epi16(pairs[i][0], p0) : p0;
            pairs[i][1] = g ? _mm256_add_epi16(pairs[i][1], p1) : p1;
            IN_ORDER(pairs[i][0]);
            IN_ORDER(pairs[i][1]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int h = 0; h < 2; h++) dot[i][h] = _mm256_madd_epi16(pairs[i][h], _mm256_set1_epi16(1));
}

/* A Q8 cell's block (the sign trick above). */
AVX2_TARGET static inline void int8_dots_q8(const uint8_t *cell, const int32_t *xb, int K4, const int mt, __m256i dot[][2]) {
    const __m256i bias = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const uint8_t *q = ((const cell_q8 *)cell)->q;
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; g++) { /* quad g: 64 bytes, rows 0..7 then 8..15 */
        __m256i s0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * g)), bias); /* q */
        __m256i s1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + 64 * g + 32)), bias);
        __m256i m0 = _mm256_abs_epi8(s0), m1 = _mm256_abs_epi8(s1); /* |q|; -128 gives 0x80, read unsigned as 128 */
        for (int i = 0; i < mt; i++) {
            __m256i xq = _mm256_set1_epi32(xb[(size_t)i * K4 + g]);
            __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(xq, s0)), ones);
            __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(xq, s1)), ones);
            dot[i][0] = g ? _mm256_add_epi32(dot[i][0], p0) : p0;
            dot[i][1] = g ? _mm256_add_epi32(dot[i][1], p1) : p1;
            IN_ORDER(dot[i][0]);
            IN_ORDER(dot[i][1]);
        }
    }
}

AVX2_TARGET static inline void tile_int8_avx2_rows(const matmul_args *a, int t, int m0, const int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK, K4 = w->K / 4;
    const int32_t *x = (const int32_t *)a->x; /* quads of int8 */
    size_t cb = cell_bytes(w->kind);
    __m256 acc[INT8_ROWS][2];
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = cell_at(w, t, b);
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        const int32_t *xb = x + (size_t)m0 * K4 + b * (QK / 4);
        const float *s = a->sums + (size_t)m0 * KB + b; /* the rows' block scales, KB apart */
        __m256i dot[INT8_ROWS][2];
        __m256 d[2];
        for (int h = 0; h < 2; h++) d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 16 * h))); /* every kind's d first */
        switch (w->kind) {
        case KIND_Q4: {
            int8_dots_q4(cell, xb, K4, mt, dot);
            const int32_t *isum = a->isums + (size_t)m0 * KB + b;
            for (int h = 0; h < 2; h++) {
                __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + offsetof(cell_q4, m) + 16 * h)));
                for (int i = 0; i < mt; i++) {
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_mul_ps(d[h], _mm256_set1_ps(s[(size_t)i * KB])), acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(s[(size_t)i * KB] * (float)isum[(size_t)i * KB]), acc[i][h]);
                }
            }
            break;
        }
        case KIND_Q8:
            int8_dots_q8(cell, xb, K4, mt, dot);
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < mt; i++)
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_mul_ps(d[h], _mm256_set1_ps(s[(size_t)i * KB])), acc[i][h]);
            break;
        default: __builtin_trap(); /* a cell kind without its case here */
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm256_storeu_ps(vals, acc[i][0]);
        _mm256_storeu_ps(vals + 8, acc[i][1]);
        store_tile(a, m0 + i, t, vals);
    }
}

AVX2_TARGET static void tile_int8_avx2(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_int8_avx2_rows(a, t, m0, 1); break;
    case 2: tile_int8_avx2_rows(a, t, m0, 2); break;
    case 3: tile_int8_avx2_rows(a, t, m0, 3); break;
    default: tile_int8_avx2_rows(a, t, m0, 4); break;
    }
}

/* exp8: exp_ref's operations on 8 lanes */
AVX2_TARGET static inline __m256 exp8(__m256 x) {
    __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

AVX2_TARGET static void exp_inplace_avx2(float *v, int count) {
    int i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
    for (; i < count; i++) v[i] = exp_ref(v[i]);
}

/* The sum of squares in 8 lanes, reduced in a fixed order (widths of 8s; others: the reference). */
AVX2_TARGET static void rms_norm_avx2(const float *x, const float *w, float eps, int n, float *out) {
    if (n % 8) {
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss = fmaf(x[i], x[i], ss);
        float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
        return;
    }
    __m256 ss = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) ss = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), ss);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(ss), _mm256_extractf128_ps(ss, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m256 r = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) / (float)n + eps));
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

/* Lane j: the sum of v[j]'s 8 lanes by halving (i + (i+4), then + (i+2), + (i+1): the order of a
 * single vector's reduction here), for 8 vectors at once. */
AVX2_TARGET static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 w[4], x[2];
    for (int p = 0; p < 4; p++) /* low half: v[2p]'s lanes i + (i+4), high half: v[2p+1]'s */
        w[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20), _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    for (int r = 0; r < 2; r++) /* half c: vectors 4r + c (lanes 0-1) and 4r + 2 + c (lanes 2-3) */
        x[r] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * r], w[2 * r + 1], 0x44), _mm256_shuffle_ps(w[2 * r], w[2 * r + 1], 0xEE));
    __m256 z = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD)); /* lane 4c + e: vector 2e + c */
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* attend_ref's computation vectorised over the head dimension, its width a compile-time constant
 * (D = 32, 64 or 128), for up to ATTEND_HEADS query heads of one kv head at once. Per head and key
 * one dot product over the head's 8-float chunks in order, reduced in a fixed order (8 keys at a
 * time, each reduced as alone); the weighted sum of values over the logical order in two
 * interleaved sums (even and odd keys: two independent FMA chains), added at the end. Each element's
 * operations and their order are fixed by D alone, whatever the group; the loops only choose what
 * is loaded once for what: an 8-key group's keys (2 KB at D = 64) serve every head of the group
 * from L1, as a block of ATTEND_BLOCK keys' values does (the keys' and values' bytes, read from L2
 * for each head alone, bound this kernel: measured 11.4 ns per head and key, one Zen 3 thread, at
 * 256 and 1,024 keys alike); a full group of 8 keys takes the query chunk by chunk (one query load
 * feeds 8 FMAs), and the values' sums run over 4 chunks at a time (8 sums in registers). */
#define ATTEND_HEADS 8
#define CHUNK_STEP(s) __asm__("" : "+x"(s[0]), "+x"(s[1]), "+x"(s[2]), "+x"(s[3]), "+x"(s[4]), "+x"(s[5]), "+x"(s[6]), "+x"(s[7]))
#define ATTEND_BLOCK 32 /* even: a block boundary never splits an (even, odd) pair of keys */
AVX2_TARGET static inline void attend_heads_avx2(const attention_view *a, const float *q, float *out, int head0, int group,
                                                float *scores, const int *slots, int count, const int chunks) {
    int D = 8 * chunks, g = head0 / (a->heads / a->kv_heads);
    const float *K = a->keys + (size_t)g * a->cap * D, *V = a->values + (size_t)g * a->cap * D;
    __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)D)), best[ATTEND_HEADS];
    for (int h = 0; h < group; h++) best[h] = _mm256_set1_ps(-INFINITY);
    for (int l0 = 0; l0 < count; l0 += 8) { /* 8 keys' dot products per head, reduced together */
        int n = count - l0 < 8 ? count - l0 : 8;
        const float *k[8];
        for (int j = 0; j < n; j++) k[j] = K + (size_t)slots[l0 + j] * D;
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        for (int h = 0; h < group; h++) {
            const float *qh = q + (size_t)(head0 + h) * D;
            __m256 s[8];
            if (n == 8) { /* chunk by chunk: s[j] = q_0 k_j,0, then += q_c k_j,c in order of c */
                __m256 qc = _mm256_loadu_ps(qh);
                for (int j = 0; j < 8; j++) s[j] = _mm256_mul_ps(qc, _mm256_loadu_ps(k[j]));
#pragma GCC unroll 16
                for (int c = 1; c < chunks; c++) {
                    /* all 8 sums' step c before any step c + 1: GCC would otherwise run each key's
                     * chain of dependent FMAs through in turn, bound by their latency */
                    CHUNK_STEP(s);
                    qc = _mm256_loadu_ps(qh + 8 * c);
                    for (int j = 0; j < 8; j++) s[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k[j] + 8 * c), s[j]);
                }
            } else { /* the last few keys: the same operations key by key */
                for (int j = 0; j < n; j++) {
                    s[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(k[j]));
                    for (int c = 1; c < chunks; c++) s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(k[j] + 8 * c), s[j]);
                }
                for (int j = n; j < 8; j++) s[j] = _mm256_setzero_ps();
            }
            __m256 v = _mm256_mul_ps(sum_lanes8(s), scale);
            if (n == 8) {
                _mm256_storeu_ps(scores + (size_t)h * count + l0, v);
            } else {
                float lanes[8];
                _mm256_storeu_ps(lanes, v);
                memcpy(scores + (size_t)h * count + l0, lanes, (size_t)n * 4);
            }
            best[h] = _mm256_max_ps(best[h], _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, valid));
        }
    }
    float inv[ATTEND_HEADS];
    for (int h = 0; h < group; h++) { /* each head's softmax over its scores */
        float *sc = scores + (size_t)h * count, top_lanes[8], top = -INFINITY;
        _mm256_storeu_ps(top_lanes, best[h]);
        for (int j = 0; j < 8; j++) top = top_lanes[j] > top ? top_lanes[j] : top;
        for (int l = 0; l < count; l++) sc[l] -= top;
        exp_inplace_avx2(sc, count);
        inv[h] = 1.0f / sum_in_order(sc, count);
    }
    __m256 sums[ATTEND_HEADS][2][16]; /* [head][even, odd keys][chunk] */
    for (int h = 0; h < group; h++)
        for (int c = 0; c < chunks; c++) sums[h][0][c] = sums[h][1][c] = _mm256_setzero_ps();
    int paired = count & ~1; /* keys 0 .. paired - 1 in (even, odd) pairs; the last one alone if count is odd */
    for (int b0 = 0; b0 < paired; b0 += ATTEND_BLOCK) {
        int b1 = b0 + ATTEND_BLOCK < paired ? b0 + ATTEND_BLOCK : paired;
        for (int h = 0; h < group; h++) {
            const float *p = scores + (size_t)h * count;
            for (int c0 = 0; c0 < chunks; c0 += 4) { /* chunks c0 .. c0 + 3 (chunks is a multiple of 4) */
                const float *V0 = V + 8 * c0;
                __m256 even[4], odd[4];
                for (int c = 0; c < 4; c++) even[c] = sums[h][0][c0 + c], odd[c] = sums[h][1][c0 + c];
                for (int l = b0; l < b1; l += 2) {
                    const float *v0 = V0 + (size_t)slots[l] * D, *v1 = V0 + (size_t)slots[l + 1] * D;
                    __m256 p0 = _mm256_set1_ps(p[l]), p1 = _mm256_set1_ps(p[l + 1]);
                    for (int c = 0; c < 4; c++) {
                        even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
                        odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * c), odd[c]);
                    }
                }
                for (int c = 0; c < 4; c++) sums[h][0][c0 + c] = even[c], sums[h][1][c0 + c] = odd[c];
            }
        }
    }
    if (paired < count) { /* the last key, alone, into the even sums */
        const float *v0 = V + (size_t)slots[paired] * D;
        for (int h = 0; h < group; h++) {
            __m256 p0 = _mm256_set1_ps(scores[(size_t)h * count + paired]);
            for (int c = 0; c < chunks; c++) sums[h][0][c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), sums[h][0][c]);
        }
    }
    for (int h = 0; h < group; h++) {
        __m256 iv = _mm256_set1_ps(inv[h]);
        float *o = out + (size_t)(head0 + h) * D;
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_add_ps(sums[h][0][c], sums[h][1][c]), iv));
    }
}

AVX2_TARGET static int attend_avx2(const attention_view *a, const float *q, float *out, int head0, int group, float *scores,
                                   const int *slots, int count) {
    if (a->head_dim != 32 && a->head_dim != 64 && a->head_dim != 128) return 0;
    for (int h = head0; h < head0 + group; h += ATTEND_HEADS) {
        int part = head0 + group - h < ATTEND_HEADS ? head0 + group - h : ATTEND_HEADS;
        switch (a->head_dim) {
        case 32: attend_heads_avx2(a, q, out, h, part, scores, slots, count, 4); break;
        case 64: attend_heads_avx2(a, q, out, h, part, scores, slots, count, 8); break;
        default: attend_heads_avx2(a, q, out, h, part, scores, slots, count, 16); break;
        }
    }
    return 1;
}

void install_avx2(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_F32][kind] = (tile_kernel){tile_f32_avx2, AVX2_ROWS, ISA_AVX2};
    k->tile[LAYOUT_INT8][KIND_Q4] = (tile_kernel){tile_int8_avx2, INT8_ROWS, ISA_AVX2};
    k->tile[LAYOUT_INT8][KIND_Q8] = (tile_kernel){tile_int8_avx2, INT8_ROWS, ISA_AVX2};
    k->prepare_f32 = prepare_f32_avx2;
    k->prepare_int8 = prepare_int8_avx2;
    k->exp_inplace = exp_inplace_avx2;
    k->rms_norm = rms_norm_avx2;
    k->attend = attend_avx2;
    k->isa[OP_PREPARE_F32] = k->isa[OP_PREPARE_INT8] = k->isa[OP_EXP] = k->isa[OP_RMS_NORM] = k->isa[OP_ATTEND] = ISA_AVX2;
}

#else
void install_avx2(kernel_set *k) { (void)k; }
#endif
