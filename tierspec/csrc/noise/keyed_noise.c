/* Keyed Gumbel noise: the randomness of sampled decoding (tierspec/sampling.py's ``Noise``).
 *
 * A generation's token at position t is argmax_v(log q(v) + g_t(v)), with g_t [V] standard Gumbel noise
 * keyed by (seed, t, purpose): every drafter, rule and the plain loop read the same g_t, which is what
 * makes a lossless method's text under a seed equal to plain sampling's. One such vector is drawn per
 * verified row, so its cost is paid per row of every pass: torch.rand of V doubles and two torch
 * logarithms cost about a one-token pass of the default model (49,152 values); this file, a small
 * fraction of it (benchmarks/loop_time.py measures both).
 *
 *   r_i = mix64(key + (i + 1) · γ)                      (SplitMix64 over a counter: any i, in any order)
 *   u_i = (r_i >> 12 + ½) · 2⁻⁵²                        (in [2⁻⁵³, 1 − 2⁻⁵³], exact in float64)
 *   E_i = −ln u_i                                        (float64, rounded to float32: a standard exponential)
 *   g_i = −ln E_i                                        (float32: a standard Gumbel value)
 *
 * u never reaches 0 or 1, so g lies in [−3.6, 36.7]: no token is cut off below the top (float32
 * uniforms would bound g at 16.6). E needs float64 near u = 1, where E ≈ 1 − u; float32 holds E and g
 * to the precision the float32 result keeps. The logarithms are this file's own series, and the plain
 * loop and the AVX2 loop do the same IEEE operations in the same order (-ffp-contract=off: no fused
 * multiply-adds), so every path gives the same bits and a seed the same text on every CPU.
 *
 * Its own extension (``tierspec._keyed_noise``), not the pass engine's: sampling sits below the models in
 * the package's layers and needs nothing of the engine. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "../row_top.h"
#define HAVE_AVX2_BUILD 1
#else
#define HAVE_AVX2_BUILD 0
#endif

#define GOLDEN_GAMMA 0x9E3779B97F4A7C15ULL
#define MIX_C1 0xBF58476D1CE4E5B9ULL
#define MIX_C2 0x94D049BB133111EBULL
#define ONE_BITS 0x3FF0000000000000ULL
#define MANTISSA_BITS 0x000FFFFFFFFFFFFFULL
#define ONE_BITS_F 0x3F800000U
#define MANTISSA_BITS_F 0x007FFFFFU

/* ln 2 in two parts: e · LN2_HI is exact for the exponents that occur (|e| ≤ 128). */
#define LN2_HI 6.93147180369123816490e-01
#define LN2_LO 1.90821492927058770002e-10
#define LN2_HI_F 0.693359375f
#define LN2_LO_F -2.12194440e-4f
#define SQRT2 1.41421356237309504880
#define SQRT2_F 1.41421356f
#define INT_TO_DOUBLE_MAGIC 0x4338000000000000ULL /* 1.5 · 2⁵²: bits(magic + n) − 1.5 · 2⁵² = n */
#define INT_TO_DOUBLE_MAGIC_VALUE 6755399441055744.0

/* SplitMix64's output function (Steele, Lea and Flood 2014): a bijection of 64-bit words whose outputs
 * over a counter pass BigCrush. */
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * MIX_C1;
    z = (z ^ (z >> 27)) * MIX_C2;
    return z ^ (z >> 31);
}

static inline double as_double(uint64_t bits) {
    double d;
    memcpy(&d, &bits, sizeof d);
    return d;
}

static inline uint64_t bits_of(double d) {
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return bits;
}

static inline float as_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint32_t bits_of_float(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* The two logarithms: x = 2^e · m with m in [√½, √2), ln m = 2 atanh(s) = 2s (1 + s²/3 + s⁴/5 + …),
 * s = (m − 1)/(m + 1), |s| ≤ 0.1716 (s² ≤ 0.0295). m − 1 is exact, so ln x keeps its relative precision
 * near x = 1. Float64: five terms after the first (the next would add < 2⁻³⁶ of ln m: E goes to float32);
 * float32: four (< 2⁻²⁷). */
static inline double ln_double(double x) {
    uint64_t bits = bits_of(x);
    double m = as_double((bits & MANTISSA_BITS) | ONE_BITS); /* [1, 2) */
    double e = as_double(INT_TO_DOUBLE_MAGIC + ((bits >> 52) - 1023)) - INT_TO_DOUBLE_MAGIC_VALUE;
    int high = m > SQRT2;
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
    return e * LN2_HI + (ln_m + e * LN2_LO);
}

static inline float ln_float(float x) {
    uint32_t bits = bits_of_float(x);
    float m = as_float((bits & MANTISSA_BITS_F) | ONE_BITS_F); /* [1, 2) */
    int exponent = (int)(bits >> 23) - 127;
    int high = m > SQRT2_F;
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
    return e * LN2_HI_F + (ln_m + e * LN2_LO_F);
}

static inline float gumbel_at(uint64_t key, uint64_t i) {
    uint64_t r = mix64(key + (i + 1) * GOLDEN_GAMMA);
    double u = (as_double((r >> 12) | ONE_BITS) - 1.0) + 0x1p-53;
    float e = (float)(-ln_double(u)); /* in [1.1e-16, 36.8]: a normal float */
    return -ln_float(e);
}

/* The reference, and the path of CPUs without AVX2. */
static void fill_plain(uint64_t key, float *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = gumbel_at(key, (uint64_t)i);
}

/* The noise at chosen tokens only (a drafter's reduced vocabulary): out[i] = g(ids[i]). */
static void gather_plain(uint64_t key, const int64_t *ids, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) out[i] = gumbel_at(key, (uint64_t)ids[i]);
}

#if HAVE_AVX2_BUILD
#define AVX2 __attribute__((target("avx2")))

/* The low 64 bits of a · c for 4 lanes (AVX2 has 32 × 32 → 64-bit products only). */
AVX2 static inline __m256i mul64(__m256i a, uint64_t c) {
    __m256i c_lo = _mm256_set1_epi64x((long long)(c & 0xFFFFFFFFULL));
    __m256i c_hi = _mm256_set1_epi64x((long long)(c >> 32));
    __m256i low = _mm256_mul_epu32(a, c_lo);
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c_lo), _mm256_mul_epu32(a, c_hi));
    return _mm256_add_epi64(low, _mm256_slli_epi64(cross, 32));
}

AVX2 static inline __m256i mix64_x4(__m256i z) {
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), MIX_C1);
    z = mul64(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), MIX_C2);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

AVX2 static inline __m256d ln_double_x4(__m256d x) {
    __m256i bits = _mm256_castpd_si256(x);
    __m256d m = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x((long long)MANTISSA_BITS)),
                                                    _mm256_set1_epi64x((long long)ONE_BITS)));
    __m256i exponent = _mm256_sub_epi64(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(1023));
    __m256d e = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(_mm256_set1_epi64x((long long)INT_TO_DOUBLE_MAGIC),
                                                                   exponent)),
                              _mm256_set1_pd(INT_TO_DOUBLE_MAGIC_VALUE));
    __m256d high = _mm256_cmp_pd(m, _mm256_set1_pd(SQRT2), _CMP_GT_OQ);
    m = _mm256_blendv_pd(m, _mm256_mul_pd(m, _mm256_set1_pd(0.5)), high);
    e = _mm256_blendv_pd(e, _mm256_add_pd(e, _mm256_set1_pd(1.0)), high);
    __m256d one = _mm256_set1_pd(1.0);
    __m256d s = _mm256_div_pd(_mm256_sub_pd(m, one), _mm256_add_pd(m, one));
    __m256d z = _mm256_mul_pd(s, s);
    __m256d p = _mm256_set1_pd(1.0 / 11.0);
    p = _mm256_add_pd(_mm256_mul_pd(p, z), _mm256_set1_pd(1.0 / 9.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, z), _mm256_set1_pd(1.0 / 7.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, z), _mm256_set1_pd(1.0 / 5.0));
    p = _mm256_add_pd(_mm256_mul_pd(p, z), _mm256_set1_pd(1.0 / 3.0));
    __m256d t = _mm256_add_pd(s, s);
    __m256d ln_m = _mm256_add_pd(t, _mm256_mul_pd(t, _mm256_mul_pd(z, p)));
    return _mm256_add_pd(_mm256_mul_pd(e, _mm256_set1_pd(LN2_HI)),
                         _mm256_add_pd(ln_m, _mm256_mul_pd(e, _mm256_set1_pd(LN2_LO))));
}

AVX2 static inline __m256 ln_float_x8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32((int)MANTISSA_BITS_F)),
                                                   _mm256_set1_epi32((int)ONE_BITS_F)));
    __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(SQRT2_F), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), high);
    /* exponent + 1 where high (the comparison's all-ones lanes are −1) */
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(exponent, _mm256_castps_si256(high)));
    __m256 one = _mm256_set1_ps(1.0f);
    __m256 s = _mm256_div_ps(_mm256_sub_ps(m, one), _mm256_add_ps(m, one));
    __m256 z = _mm256_mul_ps(s, s);
    __m256 p = _mm256_set1_ps(1.0f / 9.0f);
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.0f / 7.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.0f / 5.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.0f / 3.0f));
    __m256 t = _mm256_add_ps(s, s);
    __m256 ln_m = _mm256_add_ps(t, _mm256_mul_ps(t, _mm256_mul_ps(z, p)));
    return _mm256_add_ps(_mm256_mul_ps(e, _mm256_set1_ps(LN2_HI_F)),
                         _mm256_add_ps(ln_m, _mm256_mul_ps(e, _mm256_set1_ps(LN2_LO_F))));
}

/* −ln u for 4 counters' uniforms, as float32. */
AVX2 static inline __m128 exponential_x4(__m256i counter) {
    __m256i r = mix64_x4(counter);
    __m256d u = _mm256_add_pd(_mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(r, 12),
                                                                                  _mm256_set1_epi64x((long long)ONE_BITS))),
                                            _mm256_set1_pd(1.0)),
                              _mm256_set1_pd(0x1p-53));
    return _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_setzero_pd(), ln_double_x4(u)));
}

AVX2 static void fill_avx2(uint64_t key, float *out, int64_t count) {
    int64_t i = 0;
    const __m256i step = _mm256_set1_epi64x((long long)(8 * GOLDEN_GAMMA));
    __m256i low = _mm256_setr_epi64x((long long)(key + 1 * GOLDEN_GAMMA), (long long)(key + 2 * GOLDEN_GAMMA),
                                     (long long)(key + 3 * GOLDEN_GAMMA), (long long)(key + 4 * GOLDEN_GAMMA));
    __m256i high = _mm256_add_epi64(low, _mm256_set1_epi64x((long long)(4 * GOLDEN_GAMMA)));
    for (; i + 8 <= count; i += 8) {
        __m256 e = _mm256_set_m128(exponential_x4(high), exponential_x4(low));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_setzero_ps(), ln_float_x8(e)));
        low = _mm256_add_epi64(low, step);
        high = _mm256_add_epi64(high, step);
    }
    for (; i < count; i++) out[i] = gumbel_at(key, (uint64_t)i);
}

/* ``gather_plain`` eight tokens at a time: each token's counter key + (id + 1)·γ, then the fill's own
 * operations (so the fill's bits). */
AVX2 static void gather_avx2(uint64_t key, const int64_t *ids, int64_t count, float *out) {
    const __m256i one = _mm256_set1_epi64x(1), base = _mm256_set1_epi64x((long long)key);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i low = _mm256_loadu_si256((const __m256i *)(ids + i)), high = _mm256_loadu_si256((const __m256i *)(ids + i + 4));
        low = _mm256_add_epi64(base, mul64(_mm256_add_epi64(low, one), GOLDEN_GAMMA));
        high = _mm256_add_epi64(base, mul64(_mm256_add_epi64(high, one), GOLDEN_GAMMA));
        __m256 e = _mm256_set_m128(exponential_x4(high), exponential_x4(low));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_setzero_ps(), ln_float_x8(e)));
    }
    for (; i < count; i++) out[i] = gumbel_at(key, (uint64_t)ids[i]);
}
#endif

/* ---- the perturbed argmax, without drawing every token's noise ----------------------------------------
 *
 * token = argmax_j fl(x_j + g_j) over a row x [V] (log-probabilities or logits; −inf: excluded), the first
 * of equal maxima: exactly what argmax(x + g) over the whole noise vector gives, for a fraction of its
 * cost. g_j is at most −ln v_j with v_j = 1 − u_j (since −ln(1 − v) ≥ v), and v_j ≥ 2^k_j where k_j is
 * the exponent of v_j, an integer read from the counter's bits without a logarithm. So token j can beat
 * the best score found so far only if x_j − k_j · ln 2 reaches it: every other token is passed over, and
 * only the few that can are scored exactly (gumbel_at). The bound is taken with a margin of 2⁻⁸ (far
 * above the float32 roundings of x_j + g_j and of g_j itself, ~10⁻⁵), so a token passed over is strictly
 * below the best, never tied with it. */
#define BOUND_MARGIN 0.00390625

/* The exponent k of v = (n + ½) · 2⁻⁵² for n = 2⁵² − 1 − (r >> 12): v = 1 − u exactly. */
static inline int exponent_of_v(uint64_t r) {
    uint64_t n = (1ULL << 52) - 1 - (r >> 12);
    double v_scaled = (as_double(0x4330000000000000ULL | n) - 0x1p52) + 0.5; /* n + ½, exact */
    return (int)(bits_of(v_scaled) >> 52) - 1023 - 52;
}

/* Token j scored exactly and taken where it beats the best so far (the first of equal maxima wins);
 * 1 when taken. */
static inline int take_if_better(const float *x, int64_t j, uint64_t key, float *best, int64_t *best_j) {
    float score = x[j] + gumbel_at(key, (uint64_t)j);
    if (score > *best || (score == *best && j < *best_j)) {
        *best = score, *best_j = j;
        return 1;
    }
    return 0;
}

/* Tokens from .. vocab − 1 one at a time (the plain scan; the vector scans' tails): each whose bound
 * reaches the best is scored exactly. ``skip``: a token already scored (the top; −1 for none). */
static void scan_plain(const float *x, int64_t from, int64_t vocab, uint64_t key, int64_t skip, float *best,
                       int64_t *best_j) {
    for (int64_t j = from; j < vocab; j++) {
        if (x[j] == -INFINITY || j == skip) continue;
        uint64_t r = mix64(key + ((uint64_t)j + 1) * GOLDEN_GAMMA);
        double bound = (double)x[j] - exponent_of_v(r) * 0.69314718055994530942 + BOUND_MARGIN;
        if (bound >= (double)*best) take_if_better(x, j, key, best, best_j);
    }
}

/* Scores one row; returns the token, or −1 when the row holds a NaN. A row that excludes every token
 * (all −inf: every score equal) gives its first index, as the argmax over the whole vector does; so does
 * +inf its first +inf. */
static int64_t argmax_plain(const float *x, int64_t vocab, uint64_t key) {
    int64_t top = 0;
    for (int64_t j = 0; j < vocab; j++) {
        if (x[j] != x[j]) return -1;
        if (x[j] > x[top]) top = j;
    }
    if (x[top] == -INFINITY || x[top] == INFINITY) return top;
    int64_t best_j = top;
    float best = x[top] + gumbel_at(key, (uint64_t)top);
    scan_plain(x, 0, vocab, key, top, &best, &best_j);
    return best_j;
}

#if HAVE_AVX2_BUILD
/* The same scan, four tokens' bounds at a time. */
AVX2 static int64_t argmax_avx2(const float *x, int64_t vocab, uint64_t key) {
    float top_x;
    int64_t top = row_top_avx2(x, vocab, &top_x);
    if (top < 0 || x[top] == -INFINITY || x[top] == INFINITY) return top; /* a NaN; every score equal; +inf */
    int64_t best_j = top;
    float best = x[top] + gumbel_at(key, (uint64_t)top);
    const __m256i step = _mm256_set1_epi64x((long long)(4 * GOLDEN_GAMMA));
    __m256i counter = _mm256_setr_epi64x((long long)(key + 1 * GOLDEN_GAMMA), (long long)(key + 2 * GOLDEN_GAMMA),
                                         (long long)(key + 3 * GOLDEN_GAMMA), (long long)(key + 4 * GOLDEN_GAMMA));
    const __m256i n_top = _mm256_set1_epi64x((long long)((1ULL << 52) - 1));
    const __m256i magic = _mm256_set1_epi64x((long long)0x4330000000000000ULL);
    const __m256i bias = _mm256_set1_epi64x(1023 + 52);
    int64_t j = 0;
    for (; j + 4 <= vocab; j += 4) {
        __m256i r = mix64_x4(counter);
        counter = _mm256_add_epi64(counter, step);
        __m256i n = _mm256_sub_epi64(n_top, _mm256_srli_epi64(r, 12));
        __m256d v_scaled = _mm256_add_pd(_mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(magic, n)),
                                                       _mm256_set1_pd(0x1p52)),
                                         _mm256_set1_pd(0.5));
        __m256i k = _mm256_sub_epi64(_mm256_srli_epi64(_mm256_castpd_si256(v_scaled), 52), bias);
        /* k as a double (|k| ≤ 53) by the magic-number conversion */
        __m256d k_d = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(_mm256_set1_epi64x((long long)INT_TO_DOUBLE_MAGIC), k)),
                                    _mm256_set1_pd(INT_TO_DOUBLE_MAGIC_VALUE));
        __m256d bound = _mm256_add_pd(_mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(x + j)),
                                                    _mm256_mul_pd(k_d, _mm256_set1_pd(0.69314718055994530942))),
                                      _mm256_set1_pd(BOUND_MARGIN));
        int reach = _mm256_movemask_pd(_mm256_cmp_pd(bound, _mm256_set1_pd((double)best), _CMP_GE_OQ));
        while (reach) {
            int lane = __builtin_ctz((unsigned)reach);
            reach &= reach - 1;
            int64_t t = j + lane;
            if (t != top) take_if_better(x, t, key, &best, &best_j);
        }
    }
    scan_plain(x, j, vocab, key, top, &best, &best_j);
    return best_j;
}

/* The same scan on AVX-512 (F, DQ, CD, VL): eight tokens a step, SplitMix64's products native
 * (vpmullq, where AVX2 builds each from three 32-bit products) and the bound's exponent a count of
 * leading bits: with n = (~r) >> 12 as above, k = −1 − lzcnt(~r) for n ≥ 1 and −53 for n = 0, so
 * −k = 1 + min(lzcnt(~r), 52), no float conversion of v. The tokens that can reach the best are
 * scored by gumbel_at, so the token is the plain scan's. On a Zen 4 a row of
 * the default model's 49,152 logits took 21.6 µs warm and 38.2 right after a one-row pass, against the AVX2
 * scan's 62.3 and 79.5 (benchmarks/noise_rows.py, results/zen4/int8/noise_rows.log). */
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512cd,avx512vl")))

AVX512 static inline __m512i mix64_x8(__m512i z) {
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64((long long)MIX_C1));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64((long long)MIX_C2));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* The bound of the AVX2 scan, x_j + (1 + lzcnt(~r_j)) · ln 2 + margin ≥ best, rearranged to need no float64:
 * lzcnt(~r_j) ≥ (best − ln 2 − margin − x_j) / ln 2, the right side in float32 for eight tokens at once.
 * Uncapped, 1 + lzcnt(~r) ≥ −k: the bound only loosens. Float32's roundings put the right side within
 * 2⁻¹³ of its exact value (under a fortieth of the margin) for |x_top| ≤ WIDEST_TOP, where every token near the
 * bound lies within 41 of x_top; a row beyond it takes the AVX2 scan, whose bound is in float64. */
#define WIDEST_TOP 960.0f

AVX512 static int64_t argmax_avx512(const float *x, int64_t vocab, uint64_t key) {
    int nan;
    float top_x = row_max_avx512(x, vocab, &nan);
    if (nan) return -1;
    if (top_x == -INFINITY || top_x == INFINITY) return row_top_avx512(x, vocab, &top_x); /* every score equal; +inf */
    if (!(fabsf(top_x) <= WIDEST_TOP)) return argmax_avx2(x, vocab, key);
    /* Below every score the top token can reach (g ≥ −ln 36.74 = −3.604): the top is found by the scan
     * itself, as a token that can reach the best, and no index pass is needed. */
    int64_t best_j = -1;
    float best = top_x - 4.0f;
    const float inverse_ln2 = 1.44269504088896340736f;
    __m256 reach_from = _mm256_set1_ps((float)((double)best - 0.69314718055994530942 - BOUND_MARGIN));
    const __m512i step = _mm512_set1_epi64((long long)(8 * GOLDEN_GAMMA));
    __m512i counter = _mm512_add_epi64(_mm512_set1_epi64((long long)key),
                                       _mm512_setr_epi64((long long)(1 * GOLDEN_GAMMA), (long long)(2 * GOLDEN_GAMMA),
                                                         (long long)(3 * GOLDEN_GAMMA), (long long)(4 * GOLDEN_GAMMA),
                                                         (long long)(5 * GOLDEN_GAMMA), (long long)(6 * GOLDEN_GAMMA),
                                                         (long long)(7 * GOLDEN_GAMMA), (long long)(8 * GOLDEN_GAMMA)));
    const __m256 to_lengths = _mm256_set1_ps(inverse_ln2);
    int64_t j = 0;
    for (; j + 8 <= vocab; j += 8) {
        __m512i r = mix64_x8(counter);
        counter = _mm512_add_epi64(counter, step);
        __m256 leading = _mm512_cvtepi64_ps(_mm512_lzcnt_epi64(_mm512_ternarylogic_epi64(r, r, r, 0x55))); /* of ~r */
        __m256 needed = _mm256_mul_ps(_mm256_sub_ps(reach_from, _mm256_loadu_ps(x + j)), to_lengths);
        unsigned reach = (unsigned)_mm256_cmp_ps_mask(leading, needed, _CMP_GE_OQ);
        while (reach) {
            int lane = __builtin_ctz(reach);
            reach &= reach - 1;
            if (take_if_better(x, j + lane, key, &best, &best_j))
                reach_from = _mm256_set1_ps((float)((double)best - 0.69314718055994530942 - BOUND_MARGIN));
        }
    }
    scan_plain(x, j, vocab, key, -1, &best, &best_j);
    return best_j;
}
#endif

/* The loops this build and CPU can run: 0 the plain one, 1 AVX2, 2 AVX-512 (F, DQ, CD, VL). */
enum { LOOP_PLAIN = 0, LOOP_AVX2 = 1, LOOP_AVX512 = 2 };

static int best_loop(void) {
#if HAVE_AVX2_BUILD
    __builtin_cpu_init(); /* libgcc's checks include the OS's saving of the YMM and ZMM state */
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vl"))
        return LOOP_AVX512;
    if (__builtin_cpu_supports("avx2")) return LOOP_AVX2;
#endif
    return LOOP_PLAIN;
}

/* A loop asked for that this CPU cannot run: 0 after setting a Python error. */
static int loop_usable(int loop) {
    if (loop < LOOP_PLAIN || loop > LOOP_AVX512) {
        PyErr_Format(PyExc_ValueError, "loop %d is not one of 0 (plain), 1 (AVX2), 2 (AVX-512)", loop);
        return 0;
    }
    if (loop > best_loop()) {
        PyErr_Format(PyExc_ValueError, "this CPU cannot run loop %d (its best: %d)", loop, best_loop());
        return 0;
    }
    return 1;
}

/* The first index of the largest entry of a row; −1 for a row holding a NaN. */
static int64_t row_top_plain(const float *x, int64_t vocab) {
    int64_t top = 0;
    for (int64_t j = 0; j < vocab; j++) {
        if (x[j] != x[j]) return -1;
        if (x[j] > x[top]) top = j;
    }
    return top;
}

/* One row's perturbed argmax (keys) or first maximum on the chosen loop. */
static int64_t row_token(const float *row, int64_t vocab, const uint64_t *key, int loop) {
#if HAVE_AVX2_BUILD
    float top;
    if (loop == LOOP_AVX512) return key ? argmax_avx512(row, vocab, *key) : row_top_avx512(row, vocab, &top);
    if (loop == LOOP_AVX2) return key ? argmax_avx2(row, vocab, *key) : row_top_avx2(row, vocab, &top);
#endif
    return key ? argmax_plain(row, vocab, *key) : row_top_plain(row, vocab);
}

static PyObject *py_fill_gumbel(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"keys", "rows", "vocab", "out", "loop", NULL};
    PyObject *keys_address, *out_address;
    int rows, loop;
    Py_ssize_t vocab;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OinOi", names, &keys_address, &rows, &vocab, &out_address, &loop))
        return NULL;
    if (rows < 0 || vocab < 0) return PyErr_Format(PyExc_ValueError, "rows %d and vocab %zd must be >= 0", rows, vocab);
    if (rows == 0 || vocab == 0) Py_RETURN_NONE;
    const uint64_t *keys = PyLong_AsVoidPtr(keys_address);
    float *out = keys ? PyLong_AsVoidPtr(out_address) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (!keys || !out) return PyErr_Format(PyExc_ValueError, "keys and out must be non-null addresses");
    if (!loop_usable(loop)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (int r = 0; r < rows; r++) {
        float *row = out + (size_t)r * (size_t)vocab;
#if HAVE_AVX2_BUILD
        if (loop >= LOOP_AVX2) { /* AVX-512 fills on the AVX2 loop: the scan, not the fill, is the hot one */
            fill_avx2(keys[r], row, vocab);
            continue;
        }
#endif
        fill_plain(keys[r], row, vocab);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}


static PyObject *py_gather_gumbel(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"key", "ids", "count", "vocab", "out", "loop", NULL};
    unsigned long long key;
    PyObject *ids_address, *out_address;
    Py_ssize_t count, vocab;
    int loop;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KOnnOi", names, &key, &ids_address, &count, &vocab, &out_address, &loop))
        return NULL;
    if (count < 0) return PyErr_Format(PyExc_ValueError, "count %zd must be >= 0", count);
    if (!loop_usable(loop)) return NULL;
    if (count == 0) Py_RETURN_NONE;
    const int64_t *ids = PyLong_AsVoidPtr(ids_address);
    float *out = ids ? PyLong_AsVoidPtr(out_address) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (!ids || !out) return PyErr_Format(PyExc_ValueError, "ids and out must be non-null addresses");
    for (Py_ssize_t i = 0; i < count; i++) /* before anything is written */
        if (ids[i] < 0 || ids[i] >= vocab)
            return PyErr_Format(PyExc_IndexError, "token id %lld at %zd is not among the vocabulary's %zd",
                                (long long)ids[i], i, vocab);
    Py_BEGIN_ALLOW_THREADS
#if HAVE_AVX2_BUILD
    if (loop >= LOOP_AVX2) gather_avx2((uint64_t)key, ids, count, out);
    else
#endif
        gather_plain((uint64_t)key, ids, count, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gumbel_argmax(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "rows", "vocab", "stride", "keys", "out", "loop", NULL};
    PyObject *x_address, *keys_address, *out_address;
    int rows, loop;
    Py_ssize_t vocab, stride;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OinnOOi", names, &x_address, &rows, &vocab, &stride, &keys_address,
                                     &out_address, &loop))
        return NULL;
    if (rows < 0 || vocab < 1 || stride < 0) /* stride 0: one row read for all (an expanded tensor) */
        return PyErr_Format(PyExc_ValueError, "rows %d, vocab %zd, stride %zd: expected rows >= 0, vocab >= 1, "
                            "stride >= 0", rows, vocab, stride);
    if (rows == 0) Py_RETURN_NONE;
    const float *x = PyLong_AsVoidPtr(x_address);
    const uint64_t *keys = x ? PyLong_AsVoidPtr(keys_address) : NULL;
    int64_t *out = keys ? PyLong_AsVoidPtr(out_address) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (!x || !keys || !out) return PyErr_Format(PyExc_ValueError, "x, keys and out must be non-null addresses");
    if (!loop_usable(loop)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    for (int r = 0; r < rows; r++) out[r] = row_token(x + (size_t)r * (size_t)stride, vocab, keys + r, loop);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* ``count`` entries of a tuple of ints into ``out`` (unsigned: keys; else row indices, each checked
 * against ``table_rows``); 0 after setting a Python error. */
static int read_ints(PyObject *sequence, Py_ssize_t count, uint64_t *out, int is_key, Py_ssize_t table_rows) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyNumber_Index(PyTuple_GET_ITEM(sequence, i)); /* numpy's ints too */
        if (!item) return 0;
        if (is_key) {
            out[i] = PyLong_AsUnsignedLongLong(item);
            Py_DECREF(item);
            if (PyErr_Occurred()) return 0;
            continue;
        }
        long long row = PyLong_AsLongLong(item);
        Py_DECREF(item);
        if (row == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return 0;
            PyErr_Clear(); /* beyond a long long: outside the table too */
            PyErr_Format(PyExc_IndexError, "row %zd of the rows asked is not among the scores' %zd", i, table_rows);
            return 0;
        }
        if (row < 0 || row >= table_rows) {
            PyErr_Format(PyExc_IndexError, "row %lld is not among the scores' %zd", row, table_rows);
            return 0;
        }
        out[i] = (uint64_t)row;
    }
    return 1;
}

/* The tokens of chosen rows as a list of ints, straight from Python's own objects: the decode loop takes
 * one to a few rows after every pass, when the pass has swept the caches and each numpy call on the way
 * (arrays for keys and tokens, their addresses, a NaN check) cost 10-50 µs, more than a row's argmax. */
static PyObject *py_argmax_rows(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "table_rows", "vocab", "stride", "rows", "keys", "loop", NULL};
    PyObject *x_address, *rows_arg, *keys_arg;
    Py_ssize_t table_rows, vocab, stride;
    int loop;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnnnOOi", names, &x_address, &table_rows, &vocab, &stride, &rows_arg,
                                     &keys_arg, &loop))
        return NULL;
    if (table_rows < 0 || vocab < 1 || stride < 0)
        return PyErr_Format(PyExc_ValueError, "table_rows %zd, vocab %zd, stride %zd: expected table_rows >= 0, "
                            "vocab >= 1, stride >= 0", table_rows, vocab, stride);
    if (!loop_usable(loop)) return NULL;
    const float *x = PyLong_AsVoidPtr(x_address);
    if (PyErr_Occurred()) return NULL;
    PyObject *rows_seq = NULL, *keys_seq = NULL, *result = NULL;
    uint64_t local[2 * 64], *rows = local, *keys = NULL;
    int64_t local_tokens[64], *tokens = local_tokens;
    Py_ssize_t count = table_rows;
    if (rows_arg != Py_None) {
        rows_seq = PySequence_Tuple(rows_arg); /* a snapshot: an __index__ that changes a list cannot move it */
        if (!rows_seq) return NULL;
        count = PyTuple_GET_SIZE(rows_seq);
    }
    if (keys_arg != Py_None) {
        keys_seq = PySequence_Tuple(keys_arg);
        if (!keys_seq) goto done;
        if (PyTuple_GET_SIZE(keys_seq) != count) {
            PyErr_Format(PyExc_ValueError, "%zd rows of scores need %zd keys, got %zd", count, count,
                         PyTuple_GET_SIZE(keys_seq));
            goto done;
        }
    }
    if (count == 0) {
        result = PyList_New(0);
        goto done;
    }
    if (!x) {
        PyErr_Format(PyExc_ValueError, "x must be a non-null address");
        goto done;
    }
    if ((size_t)count > SIZE_MAX / (2 * sizeof(uint64_t) + sizeof(int64_t))) {
        PyErr_NoMemory();
        goto done;
    }
    if (count > 64) {
        rows = PyMem_Malloc((size_t)count * (2 * sizeof(uint64_t) + sizeof(int64_t)));
        if (!rows) {
            PyErr_NoMemory();
            goto done;
        }
        tokens = (int64_t *)(rows + 2 * count);
    }
    keys = rows + count;
    if (rows_seq) {
        if (!read_ints(rows_seq, count, rows, 0, table_rows)) goto done;
    } else {
        for (Py_ssize_t i = 0; i < count; i++) rows[i] = (uint64_t)i;
    }
    if (keys_seq && !read_ints(keys_seq, count, keys, 1, 0)) goto done;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        tokens[i] = row_token(x + (size_t)rows[i] * (size_t)stride, vocab, keys_seq ? keys + i : NULL, loop);
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result && i < count; i++) {
        PyObject *token = PyLong_FromLongLong(tokens[i]);
        if (!token) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, token);
    }
done:
    if (rows != local) PyMem_Free(rows);
    Py_XDECREF(rows_seq);
    Py_XDECREF(keys_seq);
    return result;
}

static PyObject *py_mix64(PyObject *self, PyObject *arg) {
    (void)self;
    uint64_t z = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(mix64(z));
}

static PyObject *py_best_loop(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(best_loop());
}

static PyMethodDef methods[] = {
    {"fill_gumbel", (PyCFunction)(void (*)(void))py_fill_gumbel, METH_VARARGS | METH_KEYWORDS,
     "fill_gumbel(keys, rows, vocab, out, loop): row r of out [rows, vocab] float32 = the Gumbel noise of "
     "keys[r] (uint64 [rows]); addresses as ints; loop: 0 plain, 1 AVX2, 2 AVX-512 (the same bits)."},
    {"gather_gumbel", (PyCFunction)(void (*)(void))py_gather_gumbel, METH_VARARGS | METH_KEYWORDS,
     "gather_gumbel(key, ids, count, vocab, out, loop): out[i] (float32) = the Gumbel noise of key at token ids[i] "
     "(int64 [count]), the values fill_gumbel's whole vector holds there; addresses as ints; IndexError for an id "
     "outside 0 .. vocab - 1, nothing written."},
    {"gumbel_argmax", (PyCFunction)(void (*)(void))py_gumbel_argmax, METH_VARARGS | METH_KEYWORDS,
     "gumbel_argmax(x, rows, vocab, stride, keys, out, loop): out[r] (int64) = argmax_j(x[r, j] + g_j) with "
     "keys[r]'s noise, the first of equal maxima; -1 for a row with a NaN."},
    {"argmax_rows", (PyCFunction)(void (*)(void))py_argmax_rows, METH_VARARGS | METH_KEYWORDS,
     "argmax_rows(x, table_rows, vocab, stride, rows, keys, loop) -> list: for each chosen row of the float32 "
     "table at x [table_rows, vocab] (rows: row indices, or None for all), its first maximum (keys None) or its "
     "perturbed argmax under keys[i]'s noise, as gumbel_argmax; -1 for a row holding a NaN. IndexError for a row "
     "outside the table, ValueError for keys of another count."},
    {"mix64", py_mix64, METH_O, "SplitMix64's output function of a 64-bit word."},
    {"best_loop", py_best_loop, METH_NOARGS, "The fastest loop this CPU runs: 0 plain, 1 AVX2, 2 AVX-512 (the same bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_keyed_noise",
                                    .m_doc = "Keyed Gumbel noise for sampling (tierspec/csrc/noise).", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__keyed_noise(void) { return PyModule_Create(&module); }
