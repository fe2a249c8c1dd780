/* The AVX-512 path (F/BW/VL/DQ): float32 rows (LAYOUT_F32) in 16 lanes = a whole tile, the 8-bit
 * row preparation of LAYOUT_INT8, exp, the RMS norm and attention. Its products and the 8-bit rows
 * take the reference's order exactly (kernels_ref.c): the same bits; its norm and attention sum over
 * 16 lanes (their own order). */
#include "engine.h"

#if QE_X86
#include <immintrin.h>
#include <math.h>

#include "avx512_blocks.h"
#include "keyed_scan.h"
#include "row_top.h"

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

/* LAYOUT_F32: the stored integers (blocks.h's stored_value: Q6_K's u = q + 32) for inputs k .. k + 3
 * of sub-block j (k a multiple of 4) and the tile's 16 rows, one vector per input. */
AVX512_TARGET static KERNEL_INLINE void avx512_f32_values(const int kind, const uint8_t *cell, int j, int k, __m512i v[4]) {
    const __m512i low = _mm512_set1_epi32(0x0f);
    const uint8_t *q;
    switch (kind) {
    case KIND_Q8: { /* 16 bytes per k */
        const uint8_t *b = ((const cell_q8 *)cell)->q + 16 * k;
        for (int i = 0; i < 4; i++) v[i] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 16 * i)));
        return;
    }
    case KIND_Q4: q = ((const cell_q4 *)cell)->q; break;
    case KIND_Q4K: q = ((const cell_q4k *)cell)->q[j]; break;
    case KIND_Q5K: q = ((const cell_q5k *)cell)->q[j]; break;
    case KIND_Q6K: q = ((const cell_q6k *)cell)->q[j]; break;
    default: UNKNOWN_KIND();
    }
    /* 16 bytes per pair of k: row r's k low, k + 1 high */
    __m512i r01 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 8 * k)));
    __m512i r23 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + 8 * k + 16)));
    v[0] = _mm512_and_si512(r01, low);
    v[1] = _mm512_srli_epi32(r01, 4);
    v[2] = _mm512_and_si512(r23, low);
    v[3] = _mm512_srli_epi32(r23, 4);
    if (kind == KIND_Q5K) { /* the fifth bit of k + i: bit (k + i) % 8 of byte 16*((k + i) / 8) + r */
        __m512i bits = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(((const cell_q5k *)cell)->hi[j] + 16 * (k / 8))));
        for (int i = 0; i < 4; i++) {
            int s = k % 8 + i;
            __m512i moved = s <= 4 ? _mm512_slli_epi32(bits, 4 - s) : _mm512_srli_epi32(bits, s - 4);
            v[i] = _mm512_or_si512(v[i], _mm512_and_si512(moved, _mm512_set1_epi32(0x10)));
        }
    } else if (kind == KIND_Q6K) { /* bits 2i, 2i + 1 of byte 16*(k/4) + r are k + i's high two (u, not yet less 32) */
        __m512i bits = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(((const cell_q6k *)cell)->hi[j] + 16 * (k / 4))));
        for (int i = 0; i < 4; i++) {
            __m512i moved = 2 * i <= 4 ? _mm512_slli_epi32(bits, 4 - 2 * i) : _mm512_srli_epi32(bits, 2 * i - 4);
            v[i] = _mm512_or_si512(v[i], _mm512_and_si512(moved, _mm512_set1_epi32(0x30)));
        }
    }
}

/* LAYOUT_F32 in the reference's order: four running sums per output (by k mod 4), each of the 16
 * lanes one output row of the tile. Four chains per row keep a one-row product off the FMA's
 * latency (4 cycles); 6 rows of x at once (24 sums in registers) use each weight vector 6 times.
 * ``kind`` and ``mt`` are constants in each copy. */
#define F32_ROWS 6
AVX512_TARGET static KERNEL_INLINE void tile_f32_avx512_rows(const matmul_args *a, int t, int m0, const int mt, const int kind) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const float *x = (const float *)a->x;
    __m512 p[F32_ROWS][4];
    for (int i = 0; i < mt; i++) p[i][0] = p[i][1] = p[i][2] = p[i][3] = _mm512_setzero_ps();
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind); /* a cell's bytes per block of 32 inputs */
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
        __m512 d[2], mn = _mm512_setzero_ps();
        avx512_block_scales(kind, cell, j, d, &mn);
        const float *xb = x + (size_t)m0 * w->K + b * QK;
        for (int k = 0; k < QK; k += 4) {
            __m512i v[4];
            __m512 wk[4];
            avx512_f32_values(kind, cell, j, k, v);
            if (kind == KIND_Q6K) /* d*u - 32d = d*(u - 32) exactly (both exact, their difference too) */
                for (int e = 0; e < 4; e++)
                    wk[e] = _mm512_fmsub_ps(d[k / 16], _mm512_cvtepi32_ps(v[e]), _mm512_mul_ps(d[k / 16], _mm512_set1_ps(32.0f)));
            else
                for (int e = 0; e < 4; e++) wk[e] = _mm512_mul_ps(d[k / 16], _mm512_cvtepi32_ps(v[e]));
            for (int i = 0; i < mt; i++) {
                const float *xr = xb + (size_t)i * w->K + k;
                for (int e = 0; e < 4; e++) p[i][e] = _mm512_fmadd_ps(wk[e], _mm512_set1_ps(xr[e]), p[i][e]);
            }
        }
        if (has_minimum(kind))
            for (int i = 0; i < mt; i++) p[i][0] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), p[i][0]);
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, _mm512_add_ps(_mm512_add_ps(p[i][0], p[i][1]), _mm512_add_ps(p[i][2], p[i][3])));
        store_tile(a, m0 + i, t, vals);
    }
}

#define AVX512_F32_KIND(kind)                                                                                  \
    AVX512_TARGET static void tile_f32_avx512_##kind(const matmul_args *a, int t, int m0, int mt) {            \
        switch (mt) {                                                                                          \
        case 1: tile_f32_avx512_rows(a, t, m0, 1, kind); break;                                                \
        case 2: tile_f32_avx512_rows(a, t, m0, 2, kind); break;                                                \
        case 3: tile_f32_avx512_rows(a, t, m0, 3, kind); break;                                                \
        case 4: tile_f32_avx512_rows(a, t, m0, 4, kind); break;                                                \
        case 5: tile_f32_avx512_rows(a, t, m0, 5, kind); break;                                                \
        default: tile_f32_avx512_rows(a, t, m0, 6, kind); break;                                               \
        }                                                                                                      \
    }
AVX512_F32_KIND(KIND_Q4)
AVX512_F32_KIND(KIND_Q8)
AVX512_F32_KIND(KIND_Q4K)
AVX512_F32_KIND(KIND_Q5K)
AVX512_F32_KIND(KIND_Q6K)

/* The LAYOUT_F32 kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn tile_f32_avx512(int kind) {
    switch (kind) {
    case KIND_Q4: return tile_f32_avx512_KIND_Q4;
    case KIND_Q8: return tile_f32_avx512_KIND_Q8;
    case KIND_Q4K: return tile_f32_avx512_KIND_Q4K;
    case KIND_Q5K: return tile_f32_avx512_KIND_Q5K;
    case KIND_Q6K: return tile_f32_avx512_KIND_Q6K;
    default: UNKNOWN_KIND();
    }
}

/* LAYOUT_INT8's rows: prepare_int8_ref's steps (max, a correctly rounded division, rounding to
 * nearest even, clamping), 16 lanes at a time: the same bytes. */
AVX512_TARGET static void prepare_int8_avx512(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums) {
    int KB = K / QK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
            float scale = amax / 127.0f;
            __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
            if (scale > 0.0f) {
                __m512 sv = _mm512_set1_ps(scale);
                q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(a0, sv))));
                q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(a1, sv))));
            }
            _mm_storeu_si128((__m128i *)(xq + (size_t)m * K + b * QK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + (size_t)m * K + b * QK + 16), _mm512_cvtepi32_epi8(q1));
            scales[(size_t)m * KB + b] = scale;
            isums[(size_t)m * KB + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}

/* exp16: exp_ref's operations on 16 lanes */
AVX512_TARGET static inline __m512 exp16(__m512 x) {
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~zero, p, _mm512_castsi512_ps(e));
}

AVX512_TARGET static void exp_inplace_avx512(float *v, int count) {
    int i = 0;
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(v + i, exp16(_mm512_loadu_ps(v + i)));
    if (i < count) {
        __mmask16 tail = (__mmask16)((1u << (count - i)) - 1);
        _mm512_mask_storeu_ps(v + i, tail, exp16(_mm512_maskz_loadu_ps(tail, v + i)));
    }
}

/* The sum of squares in 16 lanes, reduced in a fixed order (widths of 16s; others: a scalar loop). */
AVX512_TARGET static void rms_norm_avx512(const float *x, const float *w, float eps, int n, float *out) {
    if (n % 16) {
        float ss = 0.0f;
        for (int i = 0; i < n; i++) ss = fmaf(x[i], x[i], ss);
        float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
        return;
    }
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) ss = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), ss);
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), r), _mm512_loadu_ps(w + i)));
}

/* Lane j: the sum of v[j]'s 16 lanes by halving (i + (i+8), then + (i+4), + (i+2), + (i+1): the
 * order _mm512_reduce_add_ps takes), for 16 vectors at once: 15 shuffle pairs and adds instead of
 * 16 reductions of 8 steps each. */
AVX512_TARGET static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int p = 0; p < 8; p++) /* quarters 0-1: v[2p]'s lanes i + (i+8), quarters 2-3: v[2p+1]'s */
        w[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0x44), _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], 0xEE));
    for (int r = 0; r < 4; r++) /* quarter c: vector 4r + c's lanes (i + (i+8)) + (i+4 ...) */
        x[r] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * r], w[2 * r + 1], 0x88), _mm512_shuffle_f32x4(w[2 * r], w[2 * r + 1], 0xDD));
    for (int s = 0; s < 2; s++) /* quarter c: vectors 8s + c (lanes 0-1) and 8s + 4 + c (lanes 2-3) */
        y[s] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * s], x[2 * s + 1], 0x44), _mm512_shuffle_ps(x[2 * s], x[2 * s + 1], 0xEE));
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD)); /* lane 4c + e: vector 4e + c */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, z);
}

/* Value sums per pass over the keys: 8 chunks of 16 floats (the even and odd sums of 128 outputs);
 * wider heads take their outputs in blocks of 128, each over all the keys (every output's sum is the
 * same whatever the blocking). */
#define VALUE_CHUNKS_AVX512 8
/* Query heads of one kv head taken together, and the keys a block of value sums covers before the
 * next head's (even: a block boundary never splits an (even, odd) pair of keys). */
#define ATTEND_HEADS_AVX512 8
#define ATTEND_BLOCK_AVX512 32

/* 16 elements of a float32 or float16 cache from element ``at`` (half a constant where inlined) */
AVX512_TARGET static inline __m512 load16_kv(const void *base, size_t at, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + at))) : _mm512_loadu_ps((const float *)base + at);
}

/* One head's softmax over its ``count`` scores, in place: exp of score − max sixteen at a time in
 * logical order (soft-capped scores first capped by softcap_scores, their maximum then taken);
 * ``best``: the running maxima of the uncapped scores. Returns 1 / the exps' sum. */
AVX512_TARGET static inline float softmax_in_place_avx512(float *sc, int count, float softcap, __m512 best) {
    float top;
    if (softcap > 0.0f) {
        softcap_scores(sc, count, softcap);
        top = -INFINITY;
        for (int l = 0; l < count; l++) top = sc[l] > top ? sc[l] : top;
    } else {
        top = _mm512_reduce_max_ps(best);
    }
    __m512 shift = _mm512_set1_ps(top), sums = _mm512_setzero_ps();
    int l16 = 0;
    for (; l16 + 16 <= count; l16 += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + l16), shift));
        _mm512_storeu_ps(sc + l16, e);
        sums = _mm512_add_ps(sums, e);
    }
    if (l16 < count) {
        __mmask16 tail = (__mmask16)((1u << (count - l16)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sc + l16), shift));
        _mm512_mask_storeu_ps(sc + l16, tail, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(tail, e));
    }
    return 1.0f / _mm512_reduce_add_ps(sums);
}

/* attend_ref's computation vectorised over the head dimension (D a multiple of 32 up to 256, a
 * compile-time constant for the common widths so that the query and the sums stay in registers), for
 * up to ATTEND_HEADS_AVX512 query heads of one kv head at once. Per head and key one dot product
 * reduced in a fixed order (16 keys at a time, each reduced as alone), scaled; soft-capped by
 * softcap_scores (the reference's code: the same bits on every path); exp and its sum 16 scores at a
 * time in logical order; the weighted sum of values in two interleaved sums (even and odd keys), added
 * at the end. Each head's operations and their order are fixed by D alone, whatever the group: the
 * loops only choose what is loaded once for what — a block of 16 keys serves every head of the group
 * from L1, as a block of ATTEND_BLOCK_AVX512 keys' values does (a one-row pass of the default model's
 * attention at 300 and 1,000 cached tokens, three query heads per kv head together against one at a
 * time: not slower, by less than a shared Zen 4 VM's noise; BENCHMARKS.md, its Zen 4 section). */
AVX512_TARGET static inline void attend_heads_avx512(const attention_view *a, const float *q, float *out, int head0, int group,
                                                    float *scores, const int *slots, int count, const int chunks, const int half) {
    int D = 16 * chunks, g = head0 / (a->heads / a->kv_heads);
    const void *K = a->keys, *V = a->values;
    size_t base = (size_t)g * a->cap * D; /* the kv head's first element */
    __m512 scale = _mm512_set1_ps(a->scale), best[ATTEND_HEADS_AVX512];
    for (int h = 0; h < group; h++) best[h] = _mm512_set1_ps(-INFINITY);
    for (int l0 = 0; l0 < count; l0 += 16) { /* 16 keys' dot products per head, reduced together */
        int n = count - l0 < 16 ? count - l0 : 16;
        __mmask16 valid = (__mmask16)((1u << n) - 1);
        for (int h = 0; h < group; h++) {
            const float *qh = q + (size_t)(head0 + h) * D;
            __m512 qv[16], s[16];
            for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
            if (n == 16) { /* a whole block: a constant trip count, so the sums stay in registers */
                for (int j = 0; j < 16; j++) {
                    size_t k = base + (size_t)slots[l0 + j] * D;
                    s[j] = _mm512_mul_ps(qv[0], load16_kv(K, k, half));
                    for (int c = 1; c < chunks; c++) s[j] = _mm512_fmadd_ps(qv[c], load16_kv(K, k + 16 * c, half), s[j]);
                }
            } else {
                for (int j = 0; j < n; j++) {
                    size_t k = base + (size_t)slots[l0 + j] * D;
                    s[j] = _mm512_mul_ps(qv[0], load16_kv(K, k, half));
                    for (int c = 1; c < chunks; c++) s[j] = _mm512_fmadd_ps(qv[c], load16_kv(K, k + 16 * c, half), s[j]);
                }
                for (int j = n; j < 16; j++) s[j] = _mm512_setzero_ps();
            }
            __m512 v = _mm512_mul_ps(sum_lanes16(s), scale);
            _mm512_mask_storeu_ps(scores + (size_t)h * count + l0, valid, v);
            best[h] = _mm512_mask_max_ps(best[h], valid, best[h], v);
        }
    }
    __m512 inv[ATTEND_HEADS_AVX512];
    for (int h = 0; h < group; h++) /* each head's softmax over its scores */
        inv[h] = _mm512_set1_ps(softmax_in_place_avx512(scores + (size_t)h * count, count, a->softcap, best[h]));
    const int block = chunks < VALUE_CHUNKS_AVX512 ? chunks : VALUE_CHUNKS_AVX512;
    int paired = count & ~1; /* keys 0 .. paired - 1 in (even, odd) pairs; the last one alone if count is odd */
    for (int c0 = 0; c0 < chunks; c0 += block) {
        /* this block's chunks: the last block of a width that is no multiple of 8 chunks is short
         * (D = 160, 192, 224; reading and writing a whole block there ran past the head) */
        const int width = chunks - c0 < block ? chunks - c0 : block;
        __m512 sums[ATTEND_HEADS_AVX512][2][VALUE_CHUNKS_AVX512];
        for (int h = 0; h < group; h++)
            for (int c = 0; c < width; c++) sums[h][0][c] = sums[h][1][c] = _mm512_setzero_ps();
        for (int b0 = 0; b0 < paired; b0 += ATTEND_BLOCK_AVX512) {
            int b1 = b0 + ATTEND_BLOCK_AVX512 < paired ? b0 + ATTEND_BLOCK_AVX512 : paired;
            for (int h = 0; h < group; h++) {
                const float *p = scores + (size_t)h * count;
                __m512 even[VALUE_CHUNKS_AVX512], odd[VALUE_CHUNKS_AVX512];
                for (int c = 0; c < width; c++) even[c] = sums[h][0][c], odd[c] = sums[h][1][c];
                for (int l = b0; l < b1; l += 2) {
                    size_t v0 = base + (size_t)slots[l] * D + 16 * c0, v1 = base + (size_t)slots[l + 1] * D + 16 * c0;
                    __m512 p0 = _mm512_set1_ps(p[l]), p1 = _mm512_set1_ps(p[l + 1]);
                    for (int c = 0; c < width; c++) {
                        even[c] = _mm512_fmadd_ps(p0, load16_kv(V, v0 + 16 * c, half), even[c]);
                        odd[c] = _mm512_fmadd_ps(p1, load16_kv(V, v1 + 16 * c, half), odd[c]);
                    }
                }
                for (int c = 0; c < width; c++) sums[h][0][c] = even[c], sums[h][1][c] = odd[c];
            }
        }
        if (paired < count) { /* the last key, alone, into the even sums */
            size_t v0 = base + (size_t)slots[paired] * D + 16 * c0;
            for (int h = 0; h < group; h++) {
                __m512 p0 = _mm512_set1_ps(scores[(size_t)h * count + paired]);
                for (int c = 0; c < width; c++) sums[h][0][c] = _mm512_fmadd_ps(p0, load16_kv(V, v0 + 16 * c, half), sums[h][0][c]);
            }
        }
        for (int h = 0; h < group; h++) {
            float *o = out + (size_t)(head0 + h) * D + 16 * c0;
            for (int c = 0; c < width; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(sums[h][0][c], sums[h][1][c]), inv[h]));
        }
    }
}

/* attend_heads_avx512 over a group of heads, by width (engine.h's ATTEND_BY_WIDTH; the same widths as
 * the AVX2 path, Phi-3's 96 among them) */
AVX512_TARGET static int attend_avx512(const attention_view *a, const float *q, float *out, int head0, int group, float *scores,
                                       const int *slots, int count) {
    ATTEND_BY_WIDTH(attend_heads_avx512, 16, ATTEND_HEADS_AVX512)
}

/* attend_heads_avx512's operations for rows j0 .. j0 + rows - 1 of a chain view (row j: slots 0 ..
 * start + j), each row's and head's in the same order as alone (kernel_set.attend_rows). The loops
 * only move: a block of ATTEND_ROWS_KEY_BLOCK keys is widened to float32 once and every row and head
 * that sees any of it takes its dot products from there (a row whose keys end inside the block takes
 * the first n, the rest of its 16 sums zero, as alone); each row's and head's softmax is the same
 * code over its scores; a block of ATTEND_ROWS_VALUE_BLOCK values is widened once and every row and
 * head adds the (even, odd) pairs of it below its own ``paired`` to its sums, kept in scratch between
 * blocks (each sum takes its terms in the same order); a row's odd last key and the scaling follow. */
AVX512_TARGET static inline void attend_rows_heads_avx512(const attention_view *a, const float *q, float *out, int j0,
                                                         int rows, int head0, int group, float *scratch,
                                                         const int chunks, const int half) {
    int D = 16 * chunks, heads = a->heads, g = head0 / (heads / a->kv_heads), keys = a->start + j0 + rows;
    int hd = heads * D, pairs = rows * group;
    const void *K = a->keys, *V = a->values;
    size_t base = (size_t)g * a->cap * D;
    float *kb = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* [KEY_BLOCK, D] */
    float *vb = kb + (size_t)ATTEND_ROWS_KEY_BLOCK * D;                 /* [VALUE_BLOCK, D] */
    float *scores = vb + (size_t)ATTEND_ROWS_VALUE_BLOCK * D;           /* [rows, group, keys] */
    float *sums = scores + (size_t)pairs * keys;                       /* [rows, group, 2, D] */
    float *bests = sums + (size_t)pairs * 2 * D;                       /* [rows, group, 16] */
    float *invs = bests + (size_t)pairs * 16;                          /* [rows, group] */
    __m512 scale = _mm512_set1_ps(a->scale);
    for (int i = 0; i < pairs; i++) _mm512_storeu_ps(bests + (size_t)i * 16, _mm512_set1_ps(-INFINITY));
    for (int l0 = 0; l0 < keys; l0 += ATTEND_ROWS_KEY_BLOCK) {
        int nb = keys - l0 < ATTEND_ROWS_KEY_BLOCK ? keys - l0 : ATTEND_ROWS_KEY_BLOCK;
        for (int j = 0; j < nb; j++)
            for (int c = 0; c < chunks; c++)
                _mm512_storeu_ps(kb + (size_t)j * D + 16 * c, load16_kv(K, base + (size_t)(l0 + j) * D + 16 * c, half));
        for (int r = 0; r < rows; r++) {
            int count = a->start + j0 + r + 1;
            if (l0 >= count) continue;
            int n = count - l0 < 16 ? count - l0 : 16;
            __mmask16 valid = (__mmask16)((1u << n) - 1);
            for (int h = 0; h < group; h++) {
                const float *qh = q + (size_t)r * hd + (size_t)(head0 + h) * D;
                __m512 qv[16], s[16];
                for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(qh + 16 * c);
                if (n == 16) { /* a whole block: a constant trip count, so the sums stay in registers */
                    for (int j = 0; j < 16; j++) {
                        const float *k = kb + (size_t)j * D;
                        s[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                        for (int c = 1; c < chunks; c++) s[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s[j]);
                    }
                } else {
                    for (int j = 0; j < n; j++) {
                        const float *k = kb + (size_t)j * D;
                        s[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                        for (int c = 1; c < chunks; c++) s[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s[j]);
                    }
                    for (int j = n; j < 16; j++) s[j] = _mm512_setzero_ps();
                }
                __m512 v = _mm512_mul_ps(sum_lanes16(s), scale);
                int at = r * group + h;
                _mm512_mask_storeu_ps(scores + (size_t)at * keys + l0, valid, v);
                float *best = bests + (size_t)at * 16;
                __m512 b = _mm512_loadu_ps(best);
                _mm512_storeu_ps(best, _mm512_mask_max_ps(b, valid, b, v));
            }
        }
    }
    for (int r = 0; r < rows; r++) { /* each row's and head's softmax over its scores */
        int count = a->start + j0 + r + 1;
        for (int h = 0; h < group; h++) {
            int at = r * group + h;
            invs[at] = softmax_in_place_avx512(scores + (size_t)at * keys, count, a->softcap,
                                               _mm512_loadu_ps(bests + (size_t)at * 16));
        }
    }
    for (int i = 0; i < pairs * 2 * chunks; i++) _mm512_storeu_ps(sums + (size_t)i * 16, _mm512_setzero_ps());
    int widest = keys & ~1; /* the largest ``paired`` of the rows (the last row's) */
    for (int b0 = 0; b0 < widest; b0 += ATTEND_ROWS_VALUE_BLOCK) {
        int b1 = b0 + ATTEND_ROWS_VALUE_BLOCK < widest ? b0 + ATTEND_ROWS_VALUE_BLOCK : widest;
        for (int l = b0; l < b1; l++)
            for (int c = 0; c < chunks; c++)
                _mm512_storeu_ps(vb + (size_t)(l - b0) * D + 16 * c, load16_kv(V, base + (size_t)l * D + 16 * c, half));
        for (int r = 0; r < rows; r++) {
            int paired = (a->start + j0 + r + 1) & ~1, end = b1 < paired ? b1 : paired;
            if (b0 >= end) continue;
            for (int h = 0; h < group; h++) {
                int at = r * group + h;
                const float *p = scores + (size_t)at * keys;
                float *even_sums = sums + (size_t)at * 2 * D, *odd_sums = even_sums + D;
                for (int c0 = 0; c0 < chunks; c0 += VALUE_CHUNKS_AVX512) {
                    const int width = chunks - c0 < VALUE_CHUNKS_AVX512 ? chunks - c0 : VALUE_CHUNKS_AVX512;
                    __m512 even[VALUE_CHUNKS_AVX512], odd[VALUE_CHUNKS_AVX512];
                    for (int c = 0; c < width; c++)
                        even[c] = _mm512_loadu_ps(even_sums + 16 * (c0 + c)), odd[c] = _mm512_loadu_ps(odd_sums + 16 * (c0 + c));
                    for (int l = b0; l < end; l += 2) {
                        const float *v0 = vb + (size_t)(l - b0) * D + 16 * c0, *v1 = v0 + D;
                        __m512 p0 = _mm512_set1_ps(p[l]), p1 = _mm512_set1_ps(p[l + 1]);
                        for (int c = 0; c < width; c++) {
                            even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
                            odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
                        }
                    }
                    for (int c = 0; c < width; c++)
                        _mm512_storeu_ps(even_sums + 16 * (c0 + c), even[c]), _mm512_storeu_ps(odd_sums + 16 * (c0 + c), odd[c]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        int count = a->start + j0 + r + 1, paired = count & ~1;
        for (int h = 0; h < group; h++) {
            int at = r * group + h;
            const float *even_sums = sums + (size_t)at * 2 * D, *odd_sums = even_sums + D;
            __m512 p0 = _mm512_set1_ps(paired < count ? scores[(size_t)at * keys + paired] : 0.0f);
            __m512 inv = _mm512_set1_ps(invs[at]);
            float *o = out + (size_t)r * hd + (size_t)(head0 + h) * D;
            for (int c = 0; c < chunks; c++) {
                __m512 even = _mm512_loadu_ps(even_sums + 16 * c);
                if (paired < count) /* the last key, alone, into the even sums */
                    even = _mm512_fmadd_ps(p0, load16_kv(V, base + (size_t)paired * D + 16 * c, half), even);
                _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_add_ps(even, _mm512_loadu_ps(odd_sums + 16 * c)), inv));
            }
        }
    }
}

/* attend_rows_heads_avx512 by width (engine.h's ATTEND_ROWS_BY_WIDTH) */
AVX512_TARGET static int attend_rows_avx512(const attention_view *a, const float *q, float *out, int j0, int rows,
                                            int head0, int group, float *scratch) {
    ATTEND_ROWS_BY_WIDTH(attend_rows_heads_avx512, 16)
}

/* keyed_first_max_plain's answer (row_top.h: the same scan the keyed-noise extension reads rows with). */
AVX512_TARGET static int64_t first_max_avx512(const float *x, int64_t n, float *top) { return row_top_avx512(x, n, top); }

void install_avx512(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_F32][kind] = (tile_kernel){tile_f32_avx512(kind), F32_ROWS, ISA_AVX512};
    k->prepare_int8 = prepare_int8_avx512;
    k->exp_inplace = exp_inplace_avx512;
    k->rms_norm = rms_norm_avx512;
    k->attend = attend_avx512;
    k->attend_rows = attend_rows_avx512;
    k->first_max = first_max_avx512;
    k->keyed_max = keyed_stretch_avx512; /* keyed_scan.h */
    k->isa[OP_PREPARE_INT8] = k->isa[OP_EXP] = k->isa[OP_RMS_NORM] = k->isa[OP_ATTEND] = k->isa[OP_FIRST_MAX] =
        k->isa[OP_ATTEND_ROWS] = k->isa[OP_KEYED_MAX] = ISA_AVX512;
}

#else
void install_avx512(kernel_set *k) { (void)k; }
#endif
