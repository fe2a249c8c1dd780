/* The AVX2 path (AVX2 + FMA + F16C): float32 rows (LAYOUT_F32) in 8 lanes, the row preparation for
 * them, exp, the RMS norm and attention. Its products and row sums take the reference's order
 * exactly (kernels_ref.c): the same bits. */
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

/* A block's scales for the 8 output rows 8h .. 8h + 7 of a tile, as float32 (blocks.h's
 * block_scales, 8 lanes): d[hh] multiplies inputs 16hh .. 16hh + 15 (d[0] = d[1] but for Q6_K), *mn
 * the term per unit of the block's input sum (kinds with a minimum; left alone otherwise). Every
 * layout's kernels can take their scales here: they depend on the kind alone. */
AVX2_TARGET static KERNEL_INLINE void avx2_block_scales(const int kind, const uint8_t *cell, int j, int h, __m256 d[2], __m256 *mn) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    switch (kind) {
    case KIND_Q4:
        d[0] = d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(((const cell_q4 *)cell)->d + 8 * h)));
        *mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(((const cell_q4 *)cell)->m + 8 * h)));
        return;
    case KIND_Q8:
        d[0] = d[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(((const cell_q8 *)cell)->d + 8 * h)));
        return;
    case KIND_Q4K: case KIND_Q5K: { /* D = d*sc, mn = -(dmin*m): exact */
        const cell_q4k *c = (const cell_q4k *)cell;
        __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c->sc[j] + 8 * h))));
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c->mn[j] + 8 * h))));
        d[0] = d[1] = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->d + 8 * h))), sc);
        *mn = _mm256_xor_ps(sign, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->dmin + 8 * h))), m));
        return;
    }
    case KIND_Q6K: {
        const cell_q6k *c = (const cell_q6k *)cell;
        __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(c->d + 8 * h)));
        for (int hh = 0; hh < 2; hh++)
            d[hh] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c->sc[2 * j + hh] + 8 * h)))));
        return;
    }
    default: UNKNOWN_KIND();
    }
}

/* Each lane shifted so that its bit s lands at bit ``to`` (a value's high bits beside its nibble),
 * then only the bits ``keep`` kept. */
AVX2_TARGET static KERNEL_INLINE __m256i avx2_bit_to(__m256i v, int s, int to, int keep) {
    __m256i moved = s <= to ? _mm256_slli_epi32(v, to - s) : _mm256_srli_epi32(v, s - to);
    return _mm256_and_si256(moved, _mm256_set1_epi32(keep));
}

/* LAYOUT_F32: the stored integers (blocks.h's stored_value: Q6_K's u = q + 32) for inputs k .. k + 3
 * of sub-block j (k a multiple of 4) and rows 8h .. 8h + 7, one vector per input. */
AVX2_TARGET static KERNEL_INLINE void avx2_f32_values(const int kind, const uint8_t *cell, int j, int k, int h, __m256i v[4]) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    const uint8_t *q;
    switch (kind) {
    case KIND_Q8: { /* 16 bytes per k: rows 0..15 */
        const uint8_t *b = ((const cell_q8 *)cell)->q + 16 * k + 8 * h;
        for (int i = 0; i < 4; i++) v[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 16 * i)));
        return;
    }
    case KIND_Q4: q = ((const cell_q4 *)cell)->q; break;
    case KIND_Q4K: q = ((const cell_q4k *)cell)->q[j]; break;
    case KIND_Q5K: q = ((const cell_q5k *)cell)->q[j]; break;
    case KIND_Q6K: q = ((const cell_q6k *)cell)->q[j]; break;
    default: UNKNOWN_KIND();
    }
    /* 16 bytes per pair of k: row r's k low, k + 1 high */
    __m256i r01 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k + 8 * h)));
    __m256i r23 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k + 16 + 8 * h)));
    v[0] = _mm256_and_si256(r01, low);
    v[1] = _mm256_srli_epi32(r01, 4);
    v[2] = _mm256_and_si256(r23, low);
    v[3] = _mm256_srli_epi32(r23, 4);
    if (kind == KIND_Q5K) { /* the fifth bit of k + i: bit (k + i) % 8 of byte 16*((k + i) / 8) + r */
        const uint8_t *hi = ((const cell_q5k *)cell)->hi[j] + 16 * (k / 8) + 8 * h;
        __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)hi));
        for (int i = 0; i < 4; i++) v[i] = _mm256_or_si256(v[i], avx2_bit_to(bits, k % 8 + i, 4, 0x10));
    } else if (kind == KIND_Q6K) { /* bits 2i, 2i + 1 of byte 16*(k/4) + r are k + i's high two (u, not yet less 32) */
        const uint8_t *hi = ((const cell_q6k *)cell)->hi[j] + 16 * (k / 4) + 8 * h;
        __m256i bits = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)hi));
        for (int i = 0; i < 4; i++) v[i] = _mm256_or_si256(v[i], avx2_bit_to(bits, 2 * i, 4, 0x30));
    }
}

/* LAYOUT_F32 in the reference's order (four running sums per output, by k mod 4), 8 float lanes =
 * 8 output rows: the tile's two halves one after the other (4 sums x 3 rows x a half fill 12 of
 * the 16 registers), up to 3 rows of x at once. ``kind`` and ``mt`` are constants in each copy. */
#define AVX2_ROWS 3
AVX2_TARGET static KERNEL_INLINE void tile_f32_avx2_rows(const matmul_args *a, int t, int m0, const int mt, const int kind) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const float *x = (const float *)a->x;
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind); /* a cell's bytes per block of 32 inputs */
    float vals[AVX2_ROWS][TILE];
    for (int h = 0; h < 2; h++) { /* rows 8h .. 8h + 7 of the tile */
        __m256 p[AVX2_ROWS][4];
        for (int i = 0; i < mt; i++) p[i][0] = p[i][1] = p[i][2] = p[i][3] = _mm256_setzero_ps();
        for (int b = 0; b < KB; b++) {
            int j;
            const uint8_t *cell = block_cell(w, t, b, &j);
            if (h == 0) {
                const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
                for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
            }
            __m256 d[2], mn = _mm256_setzero_ps();
            avx2_block_scales(kind, cell, j, h, d, &mn);
            const float *xb = x + (size_t)m0 * w->K + b * QK;
            for (int k = 0; k < QK; k += 4) {
                __m256i v[4];
                __m256 wk[4];
                avx2_f32_values(kind, cell, j, k, h, v);
                if (kind == KIND_Q6K) /* d*u - 32d = d*(u - 32) exactly (both exact, their difference too) */
                    for (int i = 0; i < 4; i++)
                        wk[i] = _mm256_fmsub_ps(d[k / 16], _mm256_cvtepi32_ps(v[i]), _mm256_mul_ps(d[k / 16], _mm256_set1_ps(32.0f)));
                else
                    for (int i = 0; i < 4; i++) wk[i] = _mm256_mul_ps(d[k / 16], _mm256_cvtepi32_ps(v[i]));
                for (int i = 0; i < mt; i++) {
                    const float *xr = xb + (size_t)i * w->K + k;
                    for (int e = 0; e < 4; e++) p[i][e] = _mm256_fmadd_ps(wk[e], _mm256_broadcast_ss(xr + e), p[i][e]);
                }
            }
            if (has_minimum(kind))
                for (int i = 0; i < mt; i++)
                    p[i][0] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), p[i][0]);
        }
        for (int i = 0; i < mt; i++)
            _mm256_storeu_ps(vals[i] + 8 * h, _mm256_add_ps(_mm256_add_ps(p[i][0], p[i][1]), _mm256_add_ps(p[i][2], p[i][3])));
    }
    for (int i = 0; i < mt; i++) store_tile(a, m0 + i, t, vals[i]);
}

#define AVX2_F32_KIND(kind)                                                                                    \
    AVX2_TARGET static void tile_f32_avx2_##kind(const matmul_args *a, int t, int m0, int mt) {                \
        switch (mt) {                                                                                          \
        case 1: tile_f32_avx2_rows(a, t, m0, 1, kind); break;                                                  \
        case 2: tile_f32_avx2_rows(a, t, m0, 2, kind); break;                                                  \
        default: tile_f32_avx2_rows(a, t, m0, 3, kind); break;                                                 \
        }                                                                                                      \
    }
AVX2_F32_KIND(KIND_Q4)
AVX2_F32_KIND(KIND_Q8)
AVX2_F32_KIND(KIND_Q4K)
AVX2_F32_KIND(KIND_Q5K)
AVX2_F32_KIND(KIND_Q6K)

/* The LAYOUT_F32 kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn tile_f32_avx2(int kind) {
    switch (kind) {
    case KIND_Q4: return tile_f32_avx2_KIND_Q4;
    case KIND_Q8: return tile_f32_avx2_KIND_Q8;
    case KIND_Q4K: return tile_f32_avx2_KIND_Q4K;
    case KIND_Q5K: return tile_f32_avx2_KIND_Q5K;
    case KIND_Q6K: return tile_f32_avx2_KIND_Q6K;
    default: UNKNOWN_KIND();
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

/* Value sums per pass over the keys: 8 chunks of 8 floats (the even and odd sums of 64 outputs fill
 * the 16 registers); wider heads take their outputs in blocks of 64, each over all the keys (every
 * output's sum is the same whatever the blocking). */
#define VALUE_CHUNKS_AVX2 8

/* attend_ref's computation vectorised over the head dimension, its width a compile-time constant
 * (D = 32, 64, 128 or 256) so that the sums stay in registers. Per key one dot product reduced in a
 * fixed order (8 keys at a time, each reduced as alone), scaled; soft-capped by softcap_scores (the
 * reference's code: the same bits on every path); the weighted sum of values over the logical order
 * in two interleaved sums (even and odd keys: two independent FMA chains), added at the end. */
AVX2_TARGET static inline void attend_head_avx2(const attention_view *a, const float *q, float *out, int head, float *scores,
                                               const int *slots, int count, const int chunks) {
    int D = 8 * chunks, g = head / (a->heads / a->kv_heads);
    q += (size_t)head * D;
    const float *K = a->keys + (size_t)g * a->cap * D, *V = a->values + (size_t)g * a->cap * D;
    __m256 scale = _mm256_set1_ps(a->scale), best = _mm256_set1_ps(-INFINITY);
    for (int l0 = 0; l0 < count; l0 += 8) { /* 8 keys' dot products, reduced together */
        int n = count - l0 < 8 ? count - l0 : 8;
        __m256 s[8];
        for (int j = 0; j < n; j++) {
            const float *k = K + (size_t)slots[l0 + j] * D;
            s[j] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
            for (int c = 1; c < chunks; c++) s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), s[j]);
        }
        for (int j = n; j < 8; j++) s[j] = _mm256_setzero_ps();
        __m256 v = _mm256_mul_ps(sum_lanes8(s), scale);
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        memcpy(scores + l0, lanes, (size_t)n * 4);
        best = _mm256_max_ps(best, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, valid));
    }
    float top_lanes[8], top = -INFINITY;
    if (a->softcap > 0.0f) {
        softcap_scores(scores, count, a->softcap);
        for (int l = 0; l < count; l++) top = scores[l] > top ? scores[l] : top;
    } else {
        _mm256_storeu_ps(top_lanes, best);
        for (int j = 0; j < 8; j++) top = top_lanes[j] > top ? top_lanes[j] : top;
    }
    for (int l = 0; l < count; l++) scores[l] -= top;
    exp_inplace_avx2(scores, count);
    float total = sum_in_order(scores, count);
    __m256 inv = _mm256_set1_ps(1.0f / total);
    out += (size_t)head * D;
    const int block = chunks < VALUE_CHUNKS_AVX2 ? chunks : VALUE_CHUNKS_AVX2;
    for (int c0 = 0; c0 < chunks; c0 += block) {
        __m256 even[VALUE_CHUNKS_AVX2], odd[VALUE_CHUNKS_AVX2];
        for (int c = 0; c < block; c++) even[c] = odd[c] = _mm256_setzero_ps();
        int l = 0;
        for (; l + 1 < count; l += 2) {
            const float *v0 = V + (size_t)slots[l] * D + 8 * c0, *v1 = V + (size_t)slots[l + 1] * D + 8 * c0;
            __m256 p0 = _mm256_set1_ps(scores[l]), p1 = _mm256_set1_ps(scores[l + 1]);
            for (int c = 0; c < block; c++) {
                even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
                odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * c), odd[c]);
            }
        }
        if (l < count) {
            const float *v0 = V + (size_t)slots[l] * D + 8 * c0;
            __m256 p0 = _mm256_set1_ps(scores[l]);
            for (int c = 0; c < block; c++) even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
        }
        for (int c = 0; c < block; c++) _mm256_storeu_ps(out + 8 * (c0 + c), _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), inv));
    }
}

AVX2_TARGET static int attend_avx2(const attention_view *a, const float *q, float *out, int head, float *scores,
                                   const int *slots, int count) {
    switch (a->head_dim) {
    case 32: attend_head_avx2(a, q, out, head, scores, slots, count, 4); return 1;
    case 64: attend_head_avx2(a, q, out, head, scores, slots, count, 8); return 1;
    case 128: attend_head_avx2(a, q, out, head, scores, slots, count, 16); return 1;
    case 256: attend_head_avx2(a, q, out, head, scores, slots, count, 32); return 1;
    default: return 0;
    }
}

void install_avx2(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) k->tile[LAYOUT_F32][kind] = (tile_kernel){tile_f32_avx2(kind), AVX2_ROWS, ISA_AVX2};
    k->prepare_f32 = prepare_f32_avx2;
    k->exp_inplace = exp_inplace_avx2;
    k->rms_norm = rms_norm_avx2;
    k->attend = attend_avx2;
    k->isa[OP_PREPARE_F32] = k->isa[OP_EXP] = k->isa[OP_RMS_NORM] = k->isa[OP_ATTEND] = ISA_AVX2;
}

#else
void install_avx2(kernel_set *k) { (void)k; }
#endif
