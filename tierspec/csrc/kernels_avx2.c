/* The AVX2 path (AVX2 + FMA + F16C): float32 rows (LAYOUT_F32) in 8 lanes, 8-bit rows (LAYOUT_INT8)
 * by vpmaddubsw + vpmaddwd, the row preparation for both, exp, the RMS norm and attention. Its
 * products and rows take the reference's order and steps exactly (kernels_ref.c): the same bits. */
#include "engine.h"

#if QE_X86
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "keyed_scan.h"
#include "row_top.h"

/* The empty asm statements below only pin values in vector registers to steer GCC's scheduling (no
 * operation, no change to any result); under tests/simde's emulation vectors are structs, so there
 * they are left out. */
#ifdef SHIM_IMMINTRIN_H
#define REGISTERS_ASM(statement) ((void)0)
#else
#define REGISTERS_ASM(statement) statement
#endif

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

/* A LAYOUT_F32 weight: d*q as float32 (exact), 8 output rows, from the stored integers ``v``. */
AVX2_TARGET static KERNEL_INLINE __m256 avx2_f32_weight(const int kind, __m256 d, __m256i v) {
    if (kind == KIND_Q6K) /* d*u - 32d = d*(u - 32) exactly (both exact, their difference too) */
        return _mm256_fmsub_ps(d, _mm256_cvtepi32_ps(v), _mm256_mul_ps(d, _mm256_set1_ps(32.0f)));
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(v));
}

/* LAYOUT_F32 in the reference's order (four running sums per output, by k mod 4), 8 float lanes =
 * 8 output rows: the tile's two halves one after the other (4 sums x 3 rows x a half fill 12 of
 * the 16 registers), AVX2_ROWS rows of x at once. A call over a few rows forms each weight vector in
 * registers from the cell; a call over more rows (AVX2_DECODE_ROWS .. AVX2_CALL_ROWS) decodes
 * the tile's weights once into memory (decode_tile_f32) and runs its rows AVX2_ROWS at a time over
 * them: the same weights, the same FMAs in the same order, so the same bits, while the decoding
 * (16 vector operations per 4 inputs and half, more than the 12 FMAs of 3 rows) is not repeated
 * for every 3 rows. ``kind`` and ``mt`` are constants in each copy. */
#define AVX2_ROWS 3
#define AVX2_CALL_ROWS 64
/* Calls over this many rows or more decode the tile first (one thread, 3072 x 576 Q4_1 over 4 / 5 /
 * 6 / 9 / 12 rows: 18.1 / 20.6 / 20.8 / 20.9 / 21.0 GMAC/s forming the weights in registers per 3
 * rows, 18.8 / 19.8 / 23.9 / 26.2 / 27.6 decoded once) */
#define AVX2_DECODE_ROWS 5
/* The sums of a row group held in registers at this point: keeps GCC from loading the next weight
 * vectors early, which with 12 sums live spilled a sum (a store and reload in its FMA chain). */
#define KEEP_SUMS(p, mt)                                                                                       \
    do {                                                                                                       \
        for (int i_ = 0; i_ < (mt); i_++) REGISTERS_ASM(__asm__("" : "+x"(p[i_][0]), "+x"(p[i_][1]), "+x"(p[i_][2]), "+x"(p[i_][3]))); \
    } while (0)
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
                for (int e = 0; e < 4; e++) wk[e] = avx2_f32_weight(kind, d[k / 16], v[e]);
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

/* tile_f32_avx2_rows over weights decoded beforehand (decode_tile_f32): the same FMAs in the same
 * order, taken input by input so that one weight vector is live beside the 12 sums. */
AVX2_TARGET static KERNEL_INLINE void tile_f32_decoded_rows(const matmul_args *a, int t, int m0, const int mt, const int kind,
                                                            const __m256 *decoded, const __m256 *minimums) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const float *x = (const float *)a->x;
    float vals[AVX2_ROWS][TILE];
    for (int h = 0; h < 2; h++) {
        __m256 p[AVX2_ROWS][4];
        for (int i = 0; i < mt; i++) p[i][0] = p[i][1] = p[i][2] = p[i][3] = _mm256_setzero_ps();
        for (int b = 0; b < KB; b++) {
            const __m256 *wb = decoded + (size_t)(2 * b + h) * QK;
            const float *xr[AVX2_ROWS];
            for (int i = 0; i < mt; i++) xr[i] = x + (size_t)(m0 + i) * w->K + b * QK;
#pragma GCC unroll 32
            for (int k = 0; k < QK; k++) {
                __m256 wk = wb[k];
                for (int i = 0; i < mt; i++) p[i][k % 4] = _mm256_fmadd_ps(wk, _mm256_broadcast_ss(xr[i] + k), p[i][k % 4]);
                KEEP_SUMS(p, mt);
            }
            if (has_minimum(kind))
                for (int i = 0; i < mt; i++)
                    p[i][0] = _mm256_fmadd_ps(minimums[2 * b + h], _mm256_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), p[i][0]);
        }
        for (int i = 0; i < mt; i++)
            _mm256_storeu_ps(vals[i] + 8 * h, _mm256_add_ps(_mm256_add_ps(p[i][0], p[i][1]), _mm256_add_ps(p[i][2], p[i][3])));
    }
    for (int i = 0; i < mt; i++) store_tile(a, m0 + i, t, vals[i]);
}

/* Tile t's weights as the direct kernel forms them: ``decoded`` [KB][2 halves][32 inputs] vectors
 * of 8 outputs' d*q, ``minimums`` [KB][2] each block's minimum term (kinds with one). */
AVX2_TARGET static KERNEL_INLINE void decode_tile_f32(const packed_weight *w, int t, const int kind, __m256 *decoded, __m256 *minimums) {
    int KB = w->K / QK;
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind);
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
        for (int h = 0; h < 2; h++) {
            __m256 d[2], mn = _mm256_setzero_ps();
            avx2_block_scales(kind, cell, j, h, d, &mn);
            minimums[2 * b + h] = mn;
            __m256 *out = decoded + (size_t)(2 * b + h) * QK;
            for (int k = 0; k < QK; k += 4) {
                __m256i v[4];
                avx2_f32_values(kind, cell, j, k, h, v);
                for (int e = 0; e < 4; e++) out[k + e] = avx2_f32_weight(kind, d[k / 16], v[e]);
            }
        }
    }
}

static _Thread_local scratch_t scratch_decoded;

#define AVX2_F32_KIND(kind)                                                                                    \
    AVX2_TARGET static void tile_f32_avx2_##kind(const matmul_args *a, int t, int m0, int mt) {                \
        if (mt < AVX2_DECODE_ROWS) {                                                                           \
            for (int g = 0; g < mt; g += AVX2_ROWS) {                                                          \
                switch (mt - g) {                                                                              \
                case 1: tile_f32_avx2_rows(a, t, m0 + g, 1, kind); break;                                      \
                case 2: tile_f32_avx2_rows(a, t, m0 + g, 2, kind); break;                                      \
                default: tile_f32_avx2_rows(a, t, m0 + g, 3, kind); break;                                     \
                }                                                                                              \
            }                                                                                                  \
            return;                                                                                            \
        }                                                                                                      \
        int KB = a->w->K / QK;                                                                                 \
        __m256 *decoded = (__m256 *)scratch_get(&scratch_decoded, (size_t)KB * 2 * (QK + 1) * sizeof(__m256)); \
        __m256 *minimums = decoded + (size_t)KB * 2 * QK;                                                      \
        decode_tile_f32(a->w, t, kind, decoded, minimums);                                                     \
        for (int g = 0; g < mt; g += AVX2_ROWS) {                                                              \
            switch (mt - g) {                                                                                  \
            case 1: tile_f32_decoded_rows(a, t, m0 + g, 1, kind, decoded, minimums); break;                    \
            case 2: tile_f32_decoded_rows(a, t, m0 + g, 2, kind, decoded, minimums); break;                    \
            default: tile_f32_decoded_rows(a, t, m0 + g, 3, kind, decoded, minimums); break;                   \
            }                                                                                                  \
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

/* LAYOUT_INT8 products: per block, each output's exact int32 dot product of the weight's stored
 * integers with the row's 8-bit values, then the reference's float steps (acc += dot * (d * s), and
 * for the kinds with a minimum acc += mn * (s * sum x8); Q6_K per half of the block, its dot less 32
 * times the half's 8-bit sum): the same bits as the reference and the VNNI and AMX kernels, whatever
 * the row count. 8 int32 lanes = 8 output rows (a lane holds one output's quad of k): the tile's
 * two halves are two vectors, over up to INT8_ROWS rows of x, so each weight vector is loaded once
 * for all the rows and each row's quad broadcast once for both halves.
 *
 * vpmaddubsw multiplies unsigned by signed bytes and adds adjacent pairs into int16 with
 * saturation, so each kind keeps its sums inside int16 (|x8| <= 127):
 *  - nibble kinds, stored u in 0..15 (Q4, Q4_K), 0..31 (Q5_K), 0..63 (Q6_K): a pair at most
 *    2 * u_max * 127, so int16_quads(kind) quads add up in int16 (8 * 3810, 4 * 7874, 2 * 16002, all
 *    < 32767) before vpmaddwd widens them;
 *  - Q8: stored q + 128 (0..255) would reach 2 * 255 * 127 > 32767, so the kernel takes the signed q
 *    back (xor 128) and multiplies |q| (0..128, unsigned) by x8 with q's sign (vpsignb: -x8 is in
 *    range): a pair at most 2 * 128 * 127 = 32512, widened by vpmaddwd after each quad.
 * A new cell kind adds a case to int16_quads (or its own dot helper) and to the float steps in
 * tile_int8_avx2_rows. */
#define INT8_ROWS 4

/* Keeps a running integer sum in a register where the code adds to it: without it GCC reassociates
 * the (exact) integer additions into one tree at the end of the block, computing every product
 * first and spilling them to the stack. */
#define IN_ORDER(v) REGISTERS_ASM(__asm__("" : "+x"(v)))

/* Quads of a nibble kind's products that add up in int16 before widening (see above). */
static KERNEL_INLINE int int16_quads(int kind) {
    switch (kind) {
    case KIND_Q4: case KIND_Q4K: return 8;
    case KIND_Q5K: return 4;
    case KIND_Q6K: return 2;
    default: UNKNOWN_KIND();
    }
}

/* Quad g's stored values at positions 32h .. 32h + 31 (rows 8h .. 8h + 7) with their high bits from
 * the plane (hi_slot: per quad and bit a 64-bit mask over positions 4r + k%4), ``nib`` holding the low
 * four bits: each mask bit widened to its byte and 16 << b added where set. */
AVX2_TARGET static KERNEL_INLINE __m256i avx2_int8_high(const int bits, const uint8_t *hi, int g, int h, __m256i nib) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, /* byte p takes mask byte p / 8 */
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull); /* and its bit p % 8 */
    for (int b = 0; b < bits; b++) {
        uint32_t mask;
        memcpy(&mask, hi + 8 * (bits * g + b) + 4 * h, 4);
        __m256i m = _mm256_shuffle_epi8(_mm256_set1_epi32((int)mask), spread);
        __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(m, bit), bit);
        nib = _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8((char)(16 << b))));
    }
    return nib;
}

/* Sub-block j of a nibble kind's cell: dot[i][h][part] = sum_k u[k] * x8_i[k] over outputs 8h ..
 * 8h + 7 (int32 lanes), part 0 the whole block, or for Q6_K its halves (quads 0-3, 4-7). */
AVX2_TARGET static KERNEL_INLINE void int8_dots_nibbles(const int kind, const uint8_t *cell, int j, const int32_t *xb, int K4,
                                                         const int mt, __m256i dot[][2][2]) {
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
    const int bits = high_bits(kind), run = int16_quads(kind), part_quads = kind == KIND_Q6K ? 4 : 8;
    __m256i pairs[INT8_ROWS][2];
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; g++) { /* quad g: 32 bytes, rows 0..7 in the low nibbles, 8..15 in the high */
        __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
        __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (bits) {
            w0 = avx2_int8_high(bits, hi, g, 0, w0);
            w1 = avx2_int8_high(bits, hi, g, 1, w1);
        }
        for (int i = 0; i < mt; i++) {
            __m256i xq = _mm256_set1_epi32(xb[(size_t)i * K4 + g]);
            __m256i p0 = _mm256_maddubs_epi16(w0, xq), p1 = _mm256_maddubs_epi16(w1, xq);
            pairs[i][0] = g % run ? _mm256_add_epi16(pairs[i][0], p0) : p0;
            pairs[i][1] = g % run ? _mm256_add_epi16(pairs[i][1], p1) : p1;
            IN_ORDER(pairs[i][0]);
            IN_ORDER(pairs[i][1]);
            if (g % run == run - 1) { /* widen the run into its part's int32 sums */
                int part = g / part_quads, first = g % part_quads == run - 1;
                for (int h = 0; h < 2; h++) {
                    __m256i wide = _mm256_madd_epi16(pairs[i][h], ones);
                    dot[i][h][part] = first ? wide : _mm256_add_epi32(dot[i][h][part], wide);
                }
            }
        }
    }
}

/* A Q8 cell's block (the sign trick above): dot[i][h][0]. */
AVX2_TARGET static KERNEL_INLINE void int8_dots_q8(const uint8_t *cell, const int32_t *xb, int K4, const int mt, __m256i dot[][2][2]) {
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
            dot[i][0][0] = g ? _mm256_add_epi32(dot[i][0][0], p0) : p0;
            dot[i][1][0] = g ? _mm256_add_epi32(dot[i][1][0], p1) : p1;
            IN_ORDER(dot[i][0][0]);
            IN_ORDER(dot[i][1][0]);
        }
    }
}

/* ``kind`` and ``mt`` are constants in each copy. */
AVX2_TARGET static KERNEL_INLINE void tile_int8_avx2_rows(const matmul_args *a, int t, int m0, const int mt, const int kind) {
    const packed_weight *w = a->w;
    int KB = w->K / QK, K4 = w->K / 4;
    const int32_t *x = (const int32_t *)a->x; /* quads of int8 */
    size_t block_bytes = cell_bytes(kind) / cell_blocks(kind); /* a cell's bytes per block of 32 inputs */
    __m256 acc[INT8_ROWS][2];
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
        for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
        const int32_t *xb = x + (size_t)m0 * K4 + b * (QK / 4);
        const float *s = a->sums + (size_t)m0 * KB + b; /* the rows' block scales, KB apart */
        __m256i dot[INT8_ROWS][2][2];
        if (kind == KIND_Q8) int8_dots_q8(cell, xb, K4, mt, dot);
        else int8_dots_nibbles(kind, cell, j, xb, K4, mt, dot);
        for (int h = 0; h < 2; h++) {
            __m256 d[2], mn = _mm256_setzero_ps();
            avx2_block_scales(kind, cell, j, h, d, &mn);
            for (int i = 0; i < mt; i++) {
                __m256 si = _mm256_set1_ps(s[(size_t)i * KB]);
                switch (kind) {
                case KIND_Q4: case KIND_Q4K: case KIND_Q5K: {
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h][0]), _mm256_mul_ps(d[0], si), acc[i][h]);
                    acc[i][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a->offsets[(size_t)(m0 + i) * KB + b]), acc[i][h]);
                    break;
                }
                case KIND_Q8:
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h][0]), _mm256_mul_ps(d[0], si), acc[i][h]);
                    break;
                case KIND_Q6K: { /* u = q + 32: each half's dot less 32 times the half's 8-bit sum */
                    const int32_t *half = a->half_isums + (size_t)(m0 + i) * (2 * KB) + 2 * b;
                    for (int part = 0; part < 2; part++) {
                        __m256i q = _mm256_sub_epi32(dot[i][h][part], _mm256_set1_epi32(32 * half[part]));
                        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_mul_ps(d[part], si), acc[i][h]);
                    }
                    break;
                }
                default: UNKNOWN_KIND();
                }
            }
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm256_storeu_ps(vals, acc[i][0]);
        _mm256_storeu_ps(vals + 8, acc[i][1]);
        store_tile(a, m0 + i, t, vals);
    }
}

#define AVX2_INT8_KIND(kind)                                                                                   \
    AVX2_TARGET static void tile_int8_avx2_##kind(const matmul_args *a, int t, int m0, int mt) {               \
        switch (mt) {                                                                                          \
        case 1: tile_int8_avx2_rows(a, t, m0, 1, kind); break;                                                 \
        case 2: tile_int8_avx2_rows(a, t, m0, 2, kind); break;                                                 \
        case 3: tile_int8_avx2_rows(a, t, m0, 3, kind); break;                                                 \
        default: tile_int8_avx2_rows(a, t, m0, 4, kind); break;                                                \
        }                                                                                                      \
    }
AVX2_INT8_KIND(KIND_Q4)
AVX2_INT8_KIND(KIND_Q8)
AVX2_INT8_KIND(KIND_Q4K)
AVX2_INT8_KIND(KIND_Q5K)
AVX2_INT8_KIND(KIND_Q6K)

/* The LAYOUT_INT8 kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn tile_int8_avx2(int kind) {
    switch (kind) {
    case KIND_Q4: return tile_int8_avx2_KIND_Q4;
    case KIND_Q8: return tile_int8_avx2_KIND_Q8;
    case KIND_Q4K: return tile_int8_avx2_KIND_Q4K;
    case KIND_Q5K: return tile_int8_avx2_KIND_Q5K;
    case KIND_Q6K: return tile_int8_avx2_KIND_Q6K;
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

/* One head's softmax over its ``count`` scores, in place: score − max (soft-capped scores first capped
 * by softcap_scores, their maximum then taken; else the largest of ``best``'s 8 running maxima), exp,
 * and 1 / the sum in logical order, returned. */
AVX2_TARGET static inline float softmax_in_place_avx2(float *sc, int count, float softcap, const float best[8]) {
    float top = -INFINITY;
    if (softcap > 0.0f) {
        softcap_scores(sc, count, softcap);
        for (int l = 0; l < count; l++) top = sc[l] > top ? sc[l] : top;
    } else {
        for (int j = 0; j < 8; j++) top = best[j] > top ? best[j] : top;
    }
    for (int l = 0; l < count; l++) sc[l] -= top;
    exp_inplace_avx2(sc, count);
    return 1.0f / sum_in_order(sc, count);
}

/* attend_ref's computation vectorised over the head dimension, its width a compile-time constant
 * (D a multiple of 32 up to 256), for up to ATTEND_HEADS query heads of one kv head at once. Per head and
 * key one dot product over the head's 8-float chunks in order, reduced in a fixed order (8 keys at a
 * time, each reduced as alone), scaled; soft-capped by softcap_scores (the reference's code: the
 * same bits on every path); the weighted sum of values over the logical order in two
 * interleaved sums (even and odd keys: two independent FMA chains), added at the end. Each element's
 * operations and their order are fixed by D alone, whatever the group; the loops only choose what
 * is loaded once for what: an 8-key group's keys (2 KB at D = 64) serve every head of the group
 * from L1, as a block of ATTEND_BLOCK keys' values does (the keys' and values' bytes, read from L2
 * for each head alone, bound this kernel: measured 11.4 ns per head and key, one Zen 3 thread, at
 * 256 and 1,024 keys alike); a full group of 8 keys takes the query chunk by chunk (one query load
 * feeds 8 FMAs), and the values' sums run over 4 chunks at a time (8 sums in registers). */
#define ATTEND_HEADS 8
#define CHUNK_STEP(s) REGISTERS_ASM(__asm__("" : "+x"(s[0]), "+x"(s[1]), "+x"(s[2]), "+x"(s[3]), "+x"(s[4]), "+x"(s[5]), "+x"(s[6]), "+x"(s[7])))
#define ATTEND_BLOCK 32 /* even: a block boundary never splits an (even, odd) pair of keys */
/* 8 elements of a float32 or float16 cache from element ``at`` (half a constant where inlined) */
AVX2_TARGET static inline __m256 load8_kv(const void *base, size_t at, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at))) : _mm256_loadu_ps((const float *)base + at);
}

AVX2_TARGET static inline void attend_heads_avx2(const attention_view *a, const float *q, float *out, int head0, int group,
                                                float *scores, const int *slots, int count, const int chunks, const int half) {
    int D = 8 * chunks, g = head0 / (a->heads / a->kv_heads);
    const void *K = a->keys, *V = a->values;
    size_t base = (size_t)g * a->cap * D; /* the kv head's first element */
    __m256 scale = _mm256_set1_ps(a->scale), best[ATTEND_HEADS];
    for (int h = 0; h < group; h++) best[h] = _mm256_set1_ps(-INFINITY);
    for (int l0 = 0; l0 < count; l0 += 8) { /* 8 keys' dot products per head, reduced together */
        int n = count - l0 < 8 ? count - l0 : 8;
        size_t k[8];
        for (int j = 0; j < n; j++) k[j] = base + (size_t)slots[l0 + j] * D;
        __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        for (int h = 0; h < group; h++) {
            const float *qh = q + (size_t)(head0 + h) * D;
            __m256 s[8];
            if (n == 8) { /* chunk by chunk: s[j] = q_0 k_j,0, then += q_c k_j,c in order of c */
                __m256 qc = _mm256_loadu_ps(qh);
                for (int j = 0; j < 8; j++) s[j] = _mm256_mul_ps(qc, load8_kv(K, k[j], half));
#pragma GCC unroll 16
                for (int c = 1; c < chunks; c++) {
                    /* all 8 sums' step c before any step c + 1: GCC would otherwise run each key's
                     * chain of dependent FMAs through in turn, bound by their latency */
                    CHUNK_STEP(s);
                    qc = _mm256_loadu_ps(qh + 8 * c);
                    for (int j = 0; j < 8; j++) s[j] = _mm256_fmadd_ps(qc, load8_kv(K, k[j] + 8 * c, half), s[j]);
                }
            } else { /* the last few keys: the same operations key by key */
                for (int j = 0; j < n; j++) {
                    s[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), load8_kv(K, k[j], half));
                    for (int c = 1; c < chunks; c++) s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), load8_kv(K, k[j] + 8 * c, half), s[j]);
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
        float top_lanes[8];
        _mm256_storeu_ps(top_lanes, best[h]);
        inv[h] = softmax_in_place_avx2(scores + (size_t)h * count, count, a->softcap, top_lanes);
    }
    __m256 sums[ATTEND_HEADS][2][32]; /* [head][even, odd keys][chunk]: up to D = 256 */
    for (int h = 0; h < group; h++)
        for (int c = 0; c < chunks; c++) sums[h][0][c] = sums[h][1][c] = _mm256_setzero_ps();
    int paired = count & ~1; /* keys 0 .. paired - 1 in (even, odd) pairs; the last one alone if count is odd */
    for (int b0 = 0; b0 < paired; b0 += ATTEND_BLOCK) {
        int b1 = b0 + ATTEND_BLOCK < paired ? b0 + ATTEND_BLOCK : paired;
        for (int h = 0; h < group; h++) {
            const float *p = scores + (size_t)h * count;
            for (int c0 = 0; c0 < chunks; c0 += 4) { /* chunks c0 .. c0 + 3 (chunks is a multiple of 4) */
                size_t V0 = base + 8 * c0;
                __m256 even[4], odd[4];
                for (int c = 0; c < 4; c++) even[c] = sums[h][0][c0 + c], odd[c] = sums[h][1][c0 + c];
                for (int l = b0; l < b1; l += 2) {
                    size_t v0 = V0 + (size_t)slots[l] * D, v1 = V0 + (size_t)slots[l + 1] * D;
                    __m256 p0 = _mm256_set1_ps(p[l]), p1 = _mm256_set1_ps(p[l + 1]);
                    for (int c = 0; c < 4; c++) {
                        even[c] = _mm256_fmadd_ps(p0, load8_kv(V, v0 + 8 * c, half), even[c]);
                        odd[c] = _mm256_fmadd_ps(p1, load8_kv(V, v1 + 8 * c, half), odd[c]);
                    }
                }
                for (int c = 0; c < 4; c++) sums[h][0][c0 + c] = even[c], sums[h][1][c0 + c] = odd[c];
            }
        }
    }
    if (paired < count) { /* the last key, alone, into the even sums */
        size_t v0 = base + (size_t)slots[paired] * D;
        for (int h = 0; h < group; h++) {
            __m256 p0 = _mm256_set1_ps(scores[(size_t)h * count + paired]);
            for (int c = 0; c < chunks; c++) sums[h][0][c] = _mm256_fmadd_ps(p0, load8_kv(V, v0 + 8 * c, half), sums[h][0][c]);
        }
    }
    for (int h = 0; h < group; h++) {
        __m256 iv = _mm256_set1_ps(inv[h]);
        float *o = out + (size_t)(head0 + h) * D;
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_add_ps(sums[h][0][c], sums[h][1][c]), iv));
    }
}

/* attend_heads_avx2's operations for rows j0 .. j0 + rows - 1 of a chain view (row j: slots 0 ..
 * start + j), each row's and head's in the same order as alone (kernel_set.attend_rows): a block of
 * 8 keys is widened to float32 once and every row and head that sees any of it takes its dot
 * products from there (a whole block chunk by chunk, a row's last few keys key by key, as alone);
 * each row's and head's softmax is the same code over its scores; a block of
 * ATTEND_ROWS_VALUE_BLOCK values is widened once and every row and head adds the (even, odd) pairs
 * of it below its own ``paired`` to its sums, kept in scratch between blocks; a row's odd last key
 * and the scaling follow. */
AVX2_TARGET static inline void attend_rows_heads_avx2(const attention_view *a, const float *q, float *out, int j0, int rows,
                                                     int head0, int group, float *scratch, const int chunks, const int half) {
    int D = 8 * chunks, heads = a->heads, g = head0 / (heads / a->kv_heads), keys = a->start + j0 + rows;
    int hd = heads * D, pairs = rows * group;
    const void *K = a->keys, *V = a->values;
    size_t base = (size_t)g * a->cap * D;
    float *kb = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63); /* [8, D] (of KEY_BLOCK's room) */
    float *vb = kb + (size_t)ATTEND_ROWS_KEY_BLOCK * D;                 /* [VALUE_BLOCK, D] */
    float *scores = vb + (size_t)ATTEND_ROWS_VALUE_BLOCK * D;           /* [rows, group, keys] */
    float *sums = scores + (size_t)pairs * keys;                       /* [rows, group, 2, D] */
    float *bests = sums + (size_t)pairs * 2 * D;                       /* [rows, group, 8] (of 16) */
    float *invs = bests + (size_t)pairs * 16;                          /* [rows, group] */
    __m256 scale = _mm256_set1_ps(a->scale);
    for (int i = 0; i < pairs; i++) _mm256_storeu_ps(bests + (size_t)i * 16, _mm256_set1_ps(-INFINITY));
    for (int l0 = 0; l0 < keys; l0 += 8) {
        int nb = keys - l0 < 8 ? keys - l0 : 8;
        for (int j = 0; j < nb; j++)
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_ps(kb + (size_t)j * D + 8 * c, load8_kv(K, base + (size_t)(l0 + j) * D + 8 * c, half));
        for (int r = 0; r < rows; r++) {
            int count = a->start + j0 + r + 1;
            if (l0 >= count) continue;
            int n = count - l0 < 8 ? count - l0 : 8;
            __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
            for (int h = 0; h < group; h++) {
                const float *qh = q + (size_t)r * hd + (size_t)(head0 + h) * D;
                __m256 s[8];
                if (n == 8) { /* chunk by chunk, as alone */
                    __m256 qc = _mm256_loadu_ps(qh);
                    for (int j = 0; j < 8; j++) s[j] = _mm256_mul_ps(qc, _mm256_loadu_ps(kb + (size_t)j * D));
#pragma GCC unroll 16
                    for (int c = 1; c < chunks; c++) {
                        CHUNK_STEP(s);
                        qc = _mm256_loadu_ps(qh + 8 * c);
                        for (int j = 0; j < 8; j++) s[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + (size_t)j * D + 8 * c), s[j]);
                    }
                } else {
                    for (int j = 0; j < n; j++) {
                        s[j] = _mm256_mul_ps(_mm256_loadu_ps(qh), _mm256_loadu_ps(kb + (size_t)j * D));
                        for (int c = 1; c < chunks; c++)
                            s[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), _mm256_loadu_ps(kb + (size_t)j * D + 8 * c), s[j]);
                    }
                    for (int j = n; j < 8; j++) s[j] = _mm256_setzero_ps();
                }
                __m256 v = _mm256_mul_ps(sum_lanes8(s), scale);
                int at = r * group + h;
                float *sc = scores + (size_t)at * keys + l0;
                if (n == 8) {
                    _mm256_storeu_ps(sc, v);
                } else {
                    float lanes[8];
                    _mm256_storeu_ps(lanes, v);
                    memcpy(sc, lanes, (size_t)n * 4);
                }
                float *best = bests + (size_t)at * 16;
                _mm256_storeu_ps(best, _mm256_max_ps(_mm256_loadu_ps(best), _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, valid)));
            }
        }
    }
    for (int r = 0; r < rows; r++) { /* each row's and head's softmax over its scores */
        int count = a->start + j0 + r + 1;
        for (int h = 0; h < group; h++) {
            int at = r * group + h;
            invs[at] = softmax_in_place_avx2(scores + (size_t)at * keys, count, a->softcap, bests + (size_t)at * 16);
        }
    }
    for (int i = 0; i < pairs * 2 * chunks; i++) _mm256_storeu_ps(sums + (size_t)i * 8, _mm256_setzero_ps());
    int widest = keys & ~1; /* the largest ``paired`` of the rows (the last row's) */
    for (int b0 = 0; b0 < widest; b0 += ATTEND_ROWS_VALUE_BLOCK) {
        int b1 = b0 + ATTEND_ROWS_VALUE_BLOCK < widest ? b0 + ATTEND_ROWS_VALUE_BLOCK : widest;
        for (int l = b0; l < b1; l++)
            for (int c = 0; c < chunks; c++)
                _mm256_storeu_ps(vb + (size_t)(l - b0) * D + 8 * c, load8_kv(V, base + (size_t)l * D + 8 * c, half));
        for (int r = 0; r < rows; r++) {
            int paired = (a->start + j0 + r + 1) & ~1, end = b1 < paired ? b1 : paired;
            if (b0 >= end) continue;
            for (int h = 0; h < group; h++) {
                int at = r * group + h;
                const float *p = scores + (size_t)at * keys;
                float *even_sums = sums + (size_t)at * 2 * D, *odd_sums = even_sums + D;
                for (int c0 = 0; c0 < chunks; c0 += 4) { /* chunks c0 .. c0 + 3 (chunks is a multiple of 4) */
                    __m256 even[4], odd[4];
                    for (int c = 0; c < 4; c++)
                        even[c] = _mm256_loadu_ps(even_sums + 8 * (c0 + c)), odd[c] = _mm256_loadu_ps(odd_sums + 8 * (c0 + c));
                    for (int l = b0; l < end; l += 2) {
                        const float *v0 = vb + (size_t)(l - b0) * D + 8 * c0, *v1 = v0 + D;
                        __m256 p0 = _mm256_set1_ps(p[l]), p1 = _mm256_set1_ps(p[l + 1]);
                        for (int c = 0; c < 4; c++) {
                            even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
                            odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * c), odd[c]);
                        }
                    }
                    for (int c = 0; c < 4; c++)
                        _mm256_storeu_ps(even_sums + 8 * (c0 + c), even[c]), _mm256_storeu_ps(odd_sums + 8 * (c0 + c), odd[c]);
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        int count = a->start + j0 + r + 1, paired = count & ~1;
        for (int h = 0; h < group; h++) {
            int at = r * group + h;
            const float *even_sums = sums + (size_t)at * 2 * D, *odd_sums = even_sums + D;
            __m256 p0 = _mm256_set1_ps(paired < count ? scores[(size_t)at * keys + paired] : 0.0f);
            __m256 iv = _mm256_set1_ps(invs[at]);
            float *o = out + (size_t)r * hd + (size_t)(head0 + h) * D;
            for (int c = 0; c < chunks; c++) {
                __m256 even = _mm256_loadu_ps(even_sums + 8 * c);
                if (paired < count) /* the last key, alone, into the even sums */
                    even = _mm256_fmadd_ps(p0, load8_kv(V, base + (size_t)paired * D + 8 * c, half), even);
                _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(_mm256_add_ps(even, _mm256_loadu_ps(odd_sums + 8 * c)), iv));
            }
        }
    }
}

/* attend_rows_heads_avx2 by width (engine.h's ATTEND_ROWS_BY_WIDTH) */
AVX2_TARGET static int attend_rows_avx2(const attention_view *a, const float *q, float *out, int j0, int rows, int head0,
                                        int group, float *scratch) {
    ATTEND_ROWS_BY_WIDTH(attend_rows_heads_avx2, 8)
}

/* half_from_float's bits, 8 at a time: clamped to +-65504 (min/max ordered so that a NaN passes),
 * F16C's rounding to nearest even, then any subnormal result made a signed zero. */
AVX2_TARGET static void store_half_avx2(const float *x, uint16_t *out, int n) {
    const __m256 top = _mm256_set1_ps(65504.0f), bottom = _mm256_set1_ps(-65504.0f);
    const __m128i exponent = _mm_set1_epi16(0x7c00), sign = _mm_set1_epi16((short)0x8000), zero = _mm_setzero_si128();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_max_ps(bottom, _mm256_min_ps(top, _mm256_loadu_ps(x + i)));
        __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m128i tiny = _mm_cmpeq_epi16(_mm_and_si128(h, exponent), zero);
        h = _mm_blendv_epi8(h, _mm_and_si128(h, sign), tiny);
        _mm_storeu_si128((__m128i *)(out + i), h);
    }
    for (; i < n; i++) out[i] = half_from_float(x[i]);
}

/* attend_heads_avx2 over a group of heads, by width (engine.h's ATTEND_BY_WIDTH; the value sums take
 * 4 chunks of 8 at a time) */
AVX2_TARGET static int attend_avx2(const attention_view *a, const float *q, float *out, int head0, int group, float *scores,
                                   const int *slots, int count) {
    ATTEND_BY_WIDTH(attend_heads_avx2, 8, ATTEND_HEADS)
}

/* keyed_first_max_plain's answer (row_top.h: the same scan the keyed-noise extension reads rows with). */
AVX2_TARGET static int64_t first_max_avx2(const float *x, int64_t n, float *top) { return row_top_avx2(x, n, top); }

void install_avx2(kernel_set *k) {
    for (int kind = 0; kind < KINDS; kind++) {
        k->tile[LAYOUT_F32][kind] = (tile_kernel){tile_f32_avx2(kind), AVX2_CALL_ROWS, ISA_AVX2};
        k->tile[LAYOUT_INT8][kind] = (tile_kernel){tile_int8_avx2(kind), INT8_ROWS, ISA_AVX2};
    }
    k->prepare_f32 = prepare_f32_avx2;
    k->prepare_int8 = prepare_int8_avx2;
    k->exp_inplace = exp_inplace_avx2;
    k->rms_norm = rms_norm_avx2;
    k->attend = attend_avx2;
    k->attend_rows = attend_rows_avx2;
    k->store_half = store_half_avx2;
    k->first_max = first_max_avx2;
    k->keyed_max = keyed_stretch_avx2; /* keyed_scan.h */
    k->isa[OP_PREPARE_F32] = k->isa[OP_PREPARE_INT8] = k->isa[OP_EXP] = k->isa[OP_RMS_NORM] = k->isa[OP_ATTEND] =
        k->isa[OP_STORE_HALF] = k->isa[OP_FIRST_MAX] = k->isa[OP_ATTEND_ROWS] = k->isa[OP_KEYED_MAX] = ISA_AVX2;
}

#else
void install_avx2(kernel_set *k) { (void)k; }
#endif
