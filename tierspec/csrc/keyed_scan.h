/* Keyed Gumbel noise and the perturbed argmax that reads it (sampled decoding's randomness: tierspec/sampling.py's
 * ``Noise``, csrc/noise/keyed_noise.c), shared by the keyed-noise extension, which draws a row's token after
 * the pass, and the pass engine, whose LM-head product draws each chunk's token while its outputs are still in
 * the core's cache (matmul.c's ``linear_draws``). One copy of the arithmetic, so both give the same bits.
 *
 *   r_i = mix64(key + (i + 1) · γ)                      (SplitMix64 over a counter: any i, in any order)
 *   u_i = (r_i >> 12 + ½) · 2⁻⁵²                        (in [2⁻⁵³, 1 − 2⁻⁵³], exact in float64)
 *   E_i = −ln u_i                                        (float64, rounded to float32: a standard exponential)
 *   g_i = −ln E_i                                        (float32: a standard Gumbel value)
 *
 * u never reaches 0 or 1, so g lies in [−3.6, 36.7]: no token is cut off below the top (float32
 * uniforms would bound g at 16.6). E needs float64 near u = 1, where E ≈ 1 − u; float32 holds E and g
 * to the precision the float32 result keeps. The logarithms are this file's own series, and every loop does
 * the same IEEE operations in the same order (built with -ffp-contract=off: no fused multiply-adds), so every
 * path gives the same bits and a seed the same text on every CPU.
 *
 * The scans take a stretch of a row: x[0 .. count − 1] are the scores of tokens token0 .. token0 + count − 1
 * (the noise is keyed by the token's id), and the best so far (*best, *best_j, a token id) is updated in
 * place, so a row may be scanned whole or chunk by chunk and the chunks' bests compared (the larger, or the
 * earlier token of equal ones): the same token either way. keyed_stretch_plain / _avx2 / _avx512 take a
 * stretch whole: its top, then the scan. Header-only, every name prefixed keyed_ (the engine has constants
 * of its own), each vector function under its own target attribute. */
#ifndef TIERSPEC_KEYED_SCAN_H
#define TIERSPEC_KEYED_SCAN_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "row_top.h" /* the vector paths' tops */
#define KEYED_SCAN_X86 1
#else
#define KEYED_SCAN_X86 0
#endif

#define KEYED_GOLDEN_GAMMA 0x9E3779B97F4A7C15ULL
#define KEYED_MIX_C1 0xBF58476D1CE4E5B9ULL
#define KEYED_MIX_C2 0x94D049BB133111EBULL
#define KEYED_ONE_BITS 0x3FF0000000000000ULL
#define KEYED_MANTISSA_BITS 0x000FFFFFFFFFFFFFULL
#define KEYED_ONE_BITS_F 0x3F800000U
#define KEYED_MANTISSA_BITS_F 0x007FFFFFU

/* ln 2 in two parts: e · KEYED_LN2_HI is exact for the exponents that occur (|e| ≤ 128). */
#define KEYED_LN2_HI 6.93147180369123816490e-01
#define KEYED_LN2_LO 1.90821492927058770002e-10
#define KEYED_LN2_HI_F 0.693359375f
#define KEYED_LN2_LO_F -2.12194440e-4f
#define KEYED_SQRT2 1.41421356237309504880
#define KEYED_SQRT2_F 1.41421356f
#define KEYED_INT_TO_DOUBLE_MAGIC 0x4338000000000000ULL /* 1.5 · 2⁵²: bits(magic + n) − 1.5 · 2⁵² = n */
#define KEYED_INT_TO_DOUBLE_MAGIC_VALUE 6755399441055744.0

/* SplitMix64's output function (Steele, Lea and Flood 2014): a bijection of 64-bit words whose outputs
 * over a counter pass BigCrush. */
static inline uint64_t keyed_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * KEYED_MIX_C1;
    z = (z ^ (z >> 27)) * KEYED_MIX_C2;
    return z ^ (z >> 31);
}

static inline double keyed_as_double(uint64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline uint64_t keyed_bits_of(double d) {
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return bits;
}

static inline float keyed_as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t keyed_bits_of_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* The two logarithms: x = 2^e · m with m in [√½, √2), ln m = 2 atanh(s) = 2s (1 + s²/3 + s⁴/5 + …),
 * s = (m − 1)/(m + 1), |s| ≤ 0.1716 (s² ≤ 0.0295). m − 1 is exact, so ln x keeps its relative precision
 * near x = 1. Float64: five terms after the first (the next would add < 2⁻³⁶ of ln m: E goes to float32);
 * float32: four (< 2⁻²⁷). */
static inline double keyed_ln_double(double x) {
    uint64_t bits = keyed_bits_of(x);
    double m = keyed_as_double((bits & KEYED_MANTISSA_BITS) | KEYED_ONE_BITS); /* [1, 2) */
    double e = keyed_as_double(KEYED_INT_TO_DOUBLE_MAGIC + ((bits >> 52) - 1023)) - KEYED_INT_TO_DOUBLE_MAGIC_VALUE;
    int high = m > KEYED_SQRT2;
    m = high ? m * 0.5 : m;
    e = high ? e + 1.0 : e;
    double s = (m - 1.0) / (m + 1.0);
    double z = s * s;
    double p = 1.0 / 11.0;
    p = p * z + 1.0 / 9.0;
    p = p * z + 1.0 / 7.0;
    p = p * z + 1.0 / 5.0;
    p = p * z + 1.0 / 3.0;
    double t = s + s;
    double ln_m = t + t * (z * p);
    return e * KEYED_LN2_HI + (ln_m + e * KEYED_LN2_LO);
}

static inline float keyed_ln_float(float x) {
    uint32_t bits = keyed_bits_of_float(x);
    float m = keyed_as_float((bits & KEYED_MANTISSA_BITS_F) | KEYED_ONE_BITS_F); /* [1, 2) */
    int exponent = (int)(bits >> 23) - 127;
    int high = m > KEYED_SQRT2_F;
    m = high ? m * 0.5f : m;
    float e = (float)(exponent + high);
    float s = (m - 1.0f) / (m + 1.0f);
    float z = s * s;
    float p = 1.0f / 9.0f;
    p = p * z + 1.0f / 7.0f;
    p = p * z + 1.0f / 5.0f;
    p = p * z + 1.0f / 3.0f;
    float t = s + s;
    float ln_m = t + t * (z * p);
    return e * KEYED_LN2_HI_F + (ln_m + e * KEYED_LN2_LO_F);
}

static inline float keyed_gumbel_at(uint64_t key, uint64_t i) {
    uint64_t r = keyed_mix64(key + (i + 1) * KEYED_GOLDEN_GAMMA);
    double u = (keyed_as_double((r >> 12) | KEYED_ONE_BITS) - 1.0) + 0x1p-53;
    float e = (float)(-keyed_ln_double(u)); /* in [1.1e-16, 36.8]: a normal float */
    return -keyed_ln_float(e);
}

/* ---- the perturbed argmax, without drawing every token's noise ----------------------------------------
 *
 * token = argmax_j fl(x_j + g_j) over a row x [V] (log-probabilities or logits; −inf: excluded), the first
 * of equal maxima: exactly what argmax(x + g) over the whole noise vector gives, for a fraction of its
 * cost. g_j is at most −ln v_j with v_j = 1 − u_j (since −ln(1 − v) ≥ v), and v_j ≥ 2^k_j where k_j is
 * the exponent of v_j, an integer read from the counter's bits without a logarithm. So token j can beat
 * the best score found so far only if x_j − k_j · ln 2 reaches it: every other token is passed over, and
 * only the few that can are scored exactly (keyed_gumbel_at). The bound is taken with a margin of 2⁻⁸ (far
 * above the float32 roundings of x_j + g_j and of g_j itself, ~10⁻⁵), so a token passed over is strictly
 * below the best, never tied with it. */
#define KEYED_BOUND_MARGIN 0.00390625

/* The exponent k of v = (n + ½) · 2⁻⁵² for n = 2⁵² − 1 − (r >> 12): v = 1 − u exactly. */
static inline int keyed_exponent_of_v(uint64_t r) {
    uint64_t n = (1ULL << 52) - 1 - (r >> 12);
    double v_scaled = (keyed_as_double(0x4330000000000000ULL | n) - 0x1p52) + 0.5; /* n + ½, exact */
    return (int)(keyed_bits_of(v_scaled) >> 52) - 1023 - 52;
}

/* Token j (score s) scored exactly and taken where it beats the best so far (the first of equal maxima
 * wins); 1 when taken. */
static inline int keyed_take(float s, int64_t j, uint64_t key, float *best, int64_t *best_j) {
    float score = s + keyed_gumbel_at(key, (uint64_t)j);
    if (score > *best || (score == *best && j < *best_j)) {
        *best = score, *best_j = j;
        return 1;
    }
    return 0;
}

/* Stretch entries from .. count − 1 one at a time (the plain scan; the vector scans' tails): each token
 * whose bound reaches the best is scored exactly. ``skip``: a token already scored (−1 for none). */
static inline void keyed_scan_plain(const float *x, int64_t token0, int64_t from, int64_t count, uint64_t key,
                                    int64_t skip, float *best, int64_t *best_j) {
    for (int64_t i = from; i < count; i++) {
        int64_t j = token0 + i;
        if (x[i] == -INFINITY || j == skip) continue;
        uint64_t r = keyed_mix64(key + ((uint64_t)j + 1) * KEYED_GOLDEN_GAMMA);
        double bound = (double)x[i] - keyed_exponent_of_v(r) * 0.69314718055994530942 + KEYED_BOUND_MARGIN;
        if (bound >= (double)*best) keyed_take(x[i], j, key, best, best_j);
    }
}

/* What a stretch's perturbed maximum came to: found; a NaN among the scores; or a top of +inf or −inf (every
 * score excluded), which the scans do not take: the keyed-noise extension, scanning whole rows, gives such a
 * row its first maximum (what the argmax over the whole vector gives), and the engine leaves the row to it. */
enum { KEYED_FOUND = 0, KEYED_NAN = 1, KEYED_ELSEWHERE = 2 };

/* The first of the stretch's largest scores (a strictly larger one replaces it) and that score in *top; −1
 * at a NaN (*top then unset). n ≥ 1. */
static inline int64_t keyed_first_max_plain(const float *x, int64_t n, float *top) {
    int64_t best = 0;
    for (int64_t j = 0; j < n; j++) {
        if (x[j] != x[j]) return -1;
        if (x[j] > x[best]) best = j;
    }
    *top = x[best];
    return best;
}

/* The start of a stretch's scan from its first maximum x[at] (at −1: a NaN): KEYED_NAN, KEYED_ELSEWHERE, or
 * KEYED_FOUND with the best at the top's perturbed score. */
static inline int keyed_start(const float *x, int64_t at, int64_t token0, uint64_t key, float *best, int64_t *best_j) {
    if (at < 0) return KEYED_NAN;
    if (x[at] == INFINITY || x[at] == -INFINITY) return KEYED_ELSEWHERE;
    *best_j = token0 + at;
    *best = x[at] + keyed_gumbel_at(key, (uint64_t)*best_j);
    return KEYED_FOUND;
}

/* The perturbed maximum of a stretch x[0 .. n − 1] (n ≥ 1), the scores of tokens token0 .. token0 + n − 1:
 * the largest fl(x_i + g(token0 + i)) in *value and its token in *token, the first of equal ones, and
 * KEYED_FOUND; else KEYED_NAN or KEYED_ELSEWHERE (*value and *token unset). The top is scored first, then
 * every token whose bound reaches the best, one at a time. */
static inline int keyed_stretch_plain(const float *x, int64_t n, int64_t token0, uint64_t key, float *value,
                                      int64_t *token) {
    float top, best;
    int64_t best_j;
    int status = keyed_start(x, keyed_first_max_plain(x, n, &top), token0, key, &best, &best_j);
    if (status != KEYED_FOUND) return status;
    keyed_scan_plain(x, token0, 0, n, key, best_j, &best, &best_j);
    *value = best, *token = best_j;
    return KEYED_FOUND;
}

#if KEYED_SCAN_X86
#define KEYED_AVX2 __attribute__((target("avx2")))

/* The low 64 bits of a · c for 4 lanes (AVX2 has 32 × 32 → 64-bit products only). */
KEYED_AVX2 static inline __m256i keyed_mul64(__m256i a, uint64_t c) {
    __m256i c_lo = _mm256_set1_epi64x((long long)(c & 0xFFFFFFFFULL));
    __m256i c_hi = _mm256_set1_epi64x((long long)(c >> 32));
    __m256i low = _mm256_mul_epu32(a, c_lo);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c_lo), _mm256_mul_epu32(a, c_hi));
    return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

KEYED_AVX2 static inline __m256i keyed_mix64_x4(__m256i z) {
    z = keyed_mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), KEYED_MIX_C1);
    z = keyed_mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), KEYED_MIX_C2);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/* ``keyed_scan_plain`` four tokens' bounds at a time (float64 bounds: any score). */
KEYED_AVX2 static inline void keyed_scan_avx2(const float *x, int64_t token0, int64_t count, uint64_t key, int64_t skip,
                                              float *best, int64_t *best_j) {
    const __m256i step = _mm256_set1_epi64x((long long)(4 * KEYED_GOLDEN_GAMMA));
    const uint64_t first = key + ((uint64_t)token0 + 1) * KEYED_GOLDEN_GAMMA;
    __m256i counter = _mm256_setr_epi64x((long long)first, (long long)(first + KEYED_GOLDEN_GAMMA),
                                         (long long)(first + 2 * KEYED_GOLDEN_GAMMA), (long long)(first + 3 * KEYED_GOLDEN_GAMMA));
    const __m256i n_top = _mm256_set1_epi64x((long long)((1ULL << 52) - 1));
    const __m256i magic = _mm256_set1_epi64x((long long)0x4330000000000000ULL);
    const __m256i bias = _mm256_set1_epi64x(1023 + 52);
    int64_t i = 0;
    for (; i + 4 <= count; i += 4) {
        __m256i r = keyed_mix64_x4(counter);
        counter = _mm256_add_epi64(counter, step);
        __m256i n = _mm256_sub_epi64(n_top, _mm256_srli_epi64(r, 12));
        __m256d v_scaled = _mm256_add_pd(_mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(magic, n)),
                                                       _mm256_set1_pd(0x1p52)),
                                         _mm256_set1_pd(0.5));
        __m256i k = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_castpd_si256(v_scaled), 52), bias);
        /* k as a double (|k| ≤ 53) by the magic-number conversion */
        __m256d k_d = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(_mm256_set1_epi64x((long long)KEYED_INT_TO_DOUBLE_MAGIC), k)),
                                    _mm256_set1_pd(KEYED_INT_TO_DOUBLE_MAGIC_VALUE));
        __m256d bound = _mm256_add_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + i)),
                                                    _mm256_mul_pd(k_d, _mm256_set1_pd(0.69314718055994530942))),
                                      _mm256_set1_pd(KEYED_BOUND_MARGIN));
        int reach = _mm256_movemask_pd(_mm256_cmp_pd(bound, _mm256_set1_pd((double)*best), _CMP_GE_OQ));
        while (reach) {
            int lane = __builtin_ctz((unsigned)reach);
            reach &= reach - 1;
            if (token0 + i + lane != skip) keyed_take(x[i + lane], token0 + i + lane, key, best, best_j);
        }
    }
    keyed_scan_plain(x, token0, i, count, key, skip, best, best_j);
}

/* ``keyed_stretch_plain``'s answer on the AVX2 scan. */
KEYED_AVX2 static inline int keyed_stretch_avx2(const float *x, int64_t n, int64_t token0, uint64_t key, float *value,
                                                int64_t *token) {
    float top, best;
    int64_t best_j;
    int status = keyed_start(x, row_top_avx2(x, n, &top), token0, key, &best, &best_j);
    if (status != KEYED_FOUND) return status;
    keyed_scan_avx2(x, token0, n, key, best_j, &best, &best_j);
    *value = best, *token = best_j;
    return KEYED_FOUND;
}

/* The same scan on AVX-512 (F, DQ, CD, VL): eight tokens a step, SplitMix64's products native
 * (vpmullq, where AVX2 builds each from three 32-bit products) and the bound's exponent a count of
 * leading bits: with n = (~r) >> 12 as above, k = −1 − lzcnt(~r) for n ≥ 1 and −53 for n = 0, so
 * −k = 1 + min(lzcnt(~r), 52), no float conversion of v. The tokens that can reach the best are
 * scored by keyed_gumbel_at, so the token is the plain scan's. On a Zen 4 a row of
 * the default model's 49,152 logits took 21.6 µs warm and 38.2 right after a one-row pass, against the AVX2
 * scan's 62.3 and 79.5 (benchmarks/noise_rows.py, results/zen4/int8/noise_rows.log). */
#define KEYED_AVX512 __attribute__((target("avx512f,avx512dq,avx512cd,avx512vl")))

KEYED_AVX512 static inline __m512i keyed_mix64_x8(__m512i z) {
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((long long)KEYED_MIX_C1));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((long long)KEYED_MIX_C2));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* The bound of the AVX2 scan, x_j + (1 + lzcnt(~r_j)) · ln 2 + margin ≥ best, rearranged to need no float64:
 * lzcnt(~r_j) ≥ (best − ln 2 − margin − x_j) / ln 2, the right side in float32 for eight tokens at once.
 * Uncapped, 1 + lzcnt(~r) ≥ −k: the bound only loosens. Float32's roundings put the right side within
 * 2⁻¹³ of its exact value (under a fortieth of the margin) for |x_top| ≤ KEYED_WIDEST_TOP, where every token
 * near the bound lies within 41 of x_top; a stretch beyond it takes the AVX2 scan, whose bound is in float64. */
#define KEYED_WIDEST_TOP 960.0f

/* ``keyed_scan_plain`` eight tokens' bounds at a time, for a stretch whose largest score x_top has
 * |x_top| ≤ KEYED_WIDEST_TOP; the caller starts *best at x_top − 4 (below every score the top token can
 * reach, g ≥ −ln 36.74 = −3.604) with *best_j = −1, and the top is found by the scan itself. */
KEYED_AVX512 static inline void keyed_scan_avx512(const float *x, int64_t token0, int64_t count, uint64_t key,
                                                  float *best, int64_t *best_j) {
    const float inverse_ln2 = 1.44269504088896340736f;
    __m256 reach_from = _mm256_set1_ps((float)((double)*best - 0.69314718055994530942 - KEYED_BOUND_MARGIN));
    const __m512i step = _mm512_set1_epi64((long long)(8 * KEYED_GOLDEN_GAMMA));
    __m512i counter = _mm512_add_epi64(_mm512_set1_epi64((long long)(key + (uint64_t)token0 * KEYED_GOLDEN_GAMMA)),
                                       _mm512_setr_epi64((long long)(1 * KEYED_GOLDEN_GAMMA), (long long)(2 * KEYED_GOLDEN_GAMMA),
                                                         (long long)(3 * KEYED_GOLDEN_GAMMA), (long long)(4 * KEYED_GOLDEN_GAMMA),
                                                         (long long)(5 * KEYED_GOLDEN_GAMMA), (long long)(6 * KEYED_GOLDEN_GAMMA),
                                                         (long long)(7 * KEYED_GOLDEN_GAMMA), (long long)(8 * KEYED_GOLDEN_GAMMA)));
    const __m256 to_lengths = _mm256_set1_ps(inverse_ln2);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m512i r = keyed_mix64_x8(counter);
        counter = _mm512_add_epi64(counter, step);
        __m256 leading = _mm512_cvtepi64_ps(_mm512_lzcnt_epi64(_mm512_ternarylogic_epi64(r, r, r, 0x55))); /* of ~r */
        __m256 needed = _mm256_mul_ps(_mm256_sub_ps(reach_from, _mm256_loadu_ps(x + i)), to_lengths);
        unsigned reach = (unsigned)_mm256_cmp_ps_mask(leading, needed, _CMP_GE_OQ);
        while (reach) {
            int lane = __builtin_ctz(reach);
            reach &= reach - 1;
            if (keyed_take(x[i + lane], token0 + i + lane, key, best, best_j))
                reach_from = _mm256_set1_ps((float)((double)*best - 0.69314718055994530942 - KEYED_BOUND_MARGIN));
        }
    }
    keyed_scan_plain(x, token0, i, count, key, -1, best, best_j);
}

/* ``keyed_stretch_plain``'s answer on the AVX-512 scan, the best started at top − 4 (a stretch whose top lies
 * beyond KEYED_WIDEST_TOP on the AVX2 scan, whose bounds are float64). */
KEYED_AVX512 static inline int keyed_stretch_avx512(const float *x, int64_t n, int64_t token0, uint64_t key, float *value,
                                                    int64_t *token) {
    int nan;
    float top = row_max_avx512(x, n, &nan);
    if (nan) return KEYED_NAN;
    if (top == INFINITY || top == -INFINITY) return KEYED_ELSEWHERE;
    if (!(fabsf(top) <= KEYED_WIDEST_TOP)) return keyed_stretch_avx2(x, n, token0, key, value, token);
    int64_t best_j = -1;
    float best = top - 4.0f;
    keyed_scan_avx512(x, token0, n, key, &best, &best_j);
    *value = best, *token = best_j;
    return KEYED_FOUND;
}
#endif

#endif
