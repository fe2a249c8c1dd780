/* Keyed Gumbel noise: the randomness of sampled decoding (tierspec/sampling.py's ``Noise``).
 *
 * A generation's token at position t is argmax_v(log q(v) + g_t(v)), with g_t [V] standard Gumbel noise
 * keyed by (seed, t, purpose): every drafter, rule and the plain loop read the same g_t, which is what
 * makes a lossless method's text under a seed equal to plain sampling's. One such vector is drawn per
 * verified row, so its cost is paid per row of every pass: torch.rand of V doubles and two torch
 * logarithms cost about a one-token pass of the default model (49,152 values); this file, a small
 * fraction of it (benchmarks/loop_time.py measures both).
 *
 * The noise's arithmetic and the scans of the perturbed argmax are in ../keyed_scan.h, shared with the pass
 * engine (which draws a row's token inside the LM head's product): SplitMix64 over a counter keyed by
 * (seed, position, purpose), two logarithms of this project's own series, the same bits on every path.
 *
 * Its own extension (``tierspec._keyed_noise``), not the pass engine's: sampling sits below the models in
 * the package's layers and needs nothing of the engine. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../keyed_scan.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include "../row_top.h"
#define HAVE_AVX2_BUILD 1
#else
#define HAVE_AVX2_BUILD 0
#endif

/* The reference, and the path of CPUs without AVX2. */
static void fill_plain(uint64_t key, float *out, int64_t count) {
    for (int64_t i = 0; i < count; i++) out[i] = keyed_gumbel_at(key, (uint64_t)i);
}

/* The noise at chosen tokens only (a drafter's reduced vocabulary): out[i] = g(ids[i]). */
static void gather_plain(uint64_t key, const int64_t *ids, int64_t count, float *out) {
    for (int64_t i = 0; i < count; i++) out[i] = keyed_gumbel_at(key, (uint64_t)ids[i]);
}

#if HAVE_AVX2_BUILD
#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256d ln_double_x4(__m256d x) {
    __m256i bits = _mm256_castpd_si256(x);
    __m256d m = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi64x((long long)KEYED_MANTISSA_BITS)),
                                                    _mm256_set1_epi64x((long long)KEYED_ONE_BITS)));
    __m256i exponent = _mm256_sub_epi64(_mm256_srli_epi64(bits, 52), _mm256_set1_epi64x(1023));
    __m256d e = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_add_epi64(_mm256_set1_epi64x((long long)KEYED_INT_TO_DOUBLE_MAGIC),
                                                                   exponent)),
                              _mm256_set1_pd(KEYED_INT_TO_DOUBLE_MAGIC_VALUE));
    __m256d high = _mm256_cmp_pd(m, _mm256_set1_pd(KEYED_SQRT2), _CMP_GT_OQ);
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
    return _mm256_add_pd(_mm256_mul_pd(e, _mm256_set1_pd(KEYED_LN2_HI)),
                         _mm256_add_pd(ln_m, _mm256_mul_pd(e, _mm256_set1_pd(KEYED_LN2_LO))));
}

AVX2 static inline __m256 ln_float_x8(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256 m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(bits, _mm256_set1_epi32((int)KEYED_MANTISSA_BITS_F)),
                                                   _mm256_set1_epi32((int)KEYED_ONE_BITS_F)));
    __m256i exponent = _mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(127));
    __m256 high = _mm256_cmp_ps(m, _mm256_set1_ps(KEYED_SQRT2_F), _CMP_GT_OQ);
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
    return _mm256_add_ps(_mm256_mul_ps(e, _mm256_set1_ps(KEYED_LN2_HI_F)),
                         _mm256_add_ps(ln_m, _mm256_mul_ps(e, _mm256_set1_ps(KEYED_LN2_LO_F))));
}

/* −ln u for 4 counters' uniforms, as float32. */
AVX2 static inline __m128 exponential_x4(__m256i counter) {
    __m256i r = keyed_mix64_x4(counter);
    __m256d u = _mm256_add_pd(_mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(_mm256_srli_epi64(r, 12),
                                                                                  _mm256_set1_epi64x((long long)KEYED_ONE_BITS))),
                                            _mm256_set1_pd(1.0)),
                              _mm256_set1_pd(0x1p-53));
    return _mm256_cvtpd_ps(_mm256_sub_pd(_mm256_setzero_pd(), ln_double_x4(u)));
}

AVX2 static void fill_avx2(uint64_t key, float *out, int64_t count) {
    int64_t i = 0;
    const __m256i step = _mm256_set1_epi64x((long long)(8 * KEYED_GOLDEN_GAMMA));
    __m256i low = _mm256_setr_epi64x((long long)(key + 1 * KEYED_GOLDEN_GAMMA), (long long)(key + 2 * KEYED_GOLDEN_GAMMA),
                                     (long long)(key + 3 * KEYED_GOLDEN_GAMMA), (long long)(key + 4 * KEYED_GOLDEN_GAMMA));
    __m256i high = _mm256_add_epi64(low, _mm256_set1_epi64x((long long)(4 * KEYED_GOLDEN_GAMMA)));
    for (; i + 8 <= count; i += 8) {
        __m256 e = _mm256_set_m128(exponential_x4(high), exponential_x4(low));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_setzero_ps(), ln_float_x8(e)));
        low = _mm256_add_epi64(low, step);
        high = _mm256_add_epi64(high, step);
    }
    for (; i < count; i++) out[i] = keyed_gumbel_at(key, (uint64_t)i);
}

/* ``gather_plain`` eight tokens at a time: each token's counter key + (id + 1)·γ, then the fill's own
 * operations (so the fill's bits). */
AVX2 static void gather_avx2(uint64_t key, const int64_t *ids, int64_t count, float *out) {
    const __m256i one = _mm256_set1_epi64x(1), base = _mm256_set1_epi64x((long long)key);
    int64_t i = 0;
    for (; i + 8 <= count; i += 8) {
        __m256i low = _mm256_loadu_si256((const __m256i *)(ids + i)), high = _mm256_loadu_si256((const __m256i *)(ids + i + 4));
        low = _mm256_add_epi64(base, keyed_mul64(_mm256_add_epi64(low, one), KEYED_GOLDEN_GAMMA));
        high = _mm256_add_epi64(base, keyed_mul64(_mm256_add_epi64(high, one), KEYED_GOLDEN_GAMMA));
        __m256 e = _mm256_set_m128(exponential_x4(high), exponential_x4(low));
        _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_setzero_ps(), ln_float_x8(e)));
    }
    for (; i < count; i++) out[i] = keyed_gumbel_at(key, (uint64_t)ids[i]);
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

/* One row's first maximum on the chosen loop; −1 for a row holding a NaN. */
static int64_t row_first_max(const float *row, int64_t vocab, int loop) {
    float top;
#if HAVE_AVX2_BUILD
    if (loop == LOOP_AVX512) return row_top_avx512(row, vocab, &top);
    if (loop == LOOP_AVX2) return row_top_avx2(row, vocab, &top);
#endif
    return keyed_first_max_plain(row, vocab, &top);
}

/* One row's perturbed argmax (keys) or first maximum on the chosen loop: keyed_scan.h's stretch over the whole
 * row; −1 for a row holding a NaN. A row whose top is +inf or −inf (every token excluded) gives its first
 * maximum, as the argmax over the whole vector does. */
static int64_t row_token(const float *row, int64_t vocab, const uint64_t *key, int loop) {
    if (!key) return row_first_max(row, vocab, loop);
    float value;
    int64_t token = -1;
    int status;
#if HAVE_AVX2_BUILD
    if (loop == LOOP_AVX512) status = keyed_stretch_avx512(row, vocab, 0, *key, &value, &token);
    else if (loop == LOOP_AVX2) status = keyed_stretch_avx2(row, vocab, 0, *key, &value, &token);
    else
#endif
        status = keyed_stretch_plain(row, vocab, 0, *key, &value, &token);
    if (status == KEYED_ELSEWHERE) return row_first_max(row, vocab, loop);
    return status == KEYED_FOUND ? token : -1;
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

/* ---- the mass before a token under top-k and top-p (sampling.surely_allowed) ---------------------------
 *
 * Whether top-k and top-p keep a row's unfiltered draw: the nucleus keeps a token when the probability mass
 * of the tokens before it (a larger logit, or an equal one and a smaller id) is below top_p, in the row's
 * softmax or, under top-k, in the softmax of the tokens top-k keeps (every logit not below the k-th largest).
 * One pass over the row (two under both filters: the k-th largest first) where finding the nucleus sorts or
 * bins it: the caller keeps the draw only where the mass lies a margin below top_p (sampling.sure_margin), so
 * the sums need not be the nucleus's bits, only within a millionth of a float64 reference (they are within
 * 1e-7 on the default model's rows). The logits at the temperature are divided as torch
 * divides them (float32 by float32): which tokens lie before the token, and which top-k keeps, is exact. */

/* 2^n · 2^f for f in [−1/2, 1/2]: 2^f by its Taylor series to the 8th term (truncation 5e−9), 2^n as
 * the exponent's bits (n in −126 .. 126 here). */
static inline float exp2_split(float f, int n) {
    float p = 1.525273380405984e-05f;
    p = p * f + 1.5403530393381608e-04f;
    p = p * f + 1.3333558146428443e-03f;
    p = p * f + 9.618129107628477e-03f;
    p = p * f + 5.550410866482158e-02f;
    p = p * f + 2.402265069591007e-01f;
    p = p * f + 6.931471805599453e-01f;
    p = p * f + 1.0f;
    union {
        uint32_t bits;
        float value;
    } scale = {.bits = (uint32_t)(n + 127) << 23};
    return p * scale.value;
}

/* e^y for |y| <= 87 (clamped there), within a few float ulps: 2^(y log2 e) as 2^n (the exponent's bits) times
 * 2^f, f in [−1/2, 1/2], by its Taylor series to the 8th term (truncation 5e−9). Branch-free, so the compiler
 * runs it over a vector of logits at a time. */
static inline float exp_clamped(float y) {
    y = y > -87.0f ? y : -87.0f;
    y = y < 87.0f ? y : 87.0f;
    float t = y * 1.44269504088896341f;
    int n = (int)(t + (t >= 0.0f ? 0.5f : -0.5f)); /* t's nearest integer (truncation toward zero) */
    return exp2_split(t - (float)n, n);
}

/* ``s`` into a min-heap of ``size`` of the ``k`` largest values seen (it grows to k, then keeps the larger). */
static void heap_offer(float *heap, Py_ssize_t *size, Py_ssize_t k, float s) {
    Py_ssize_t at;
    if (*size < k) { /* sift up */
        at = (*size)++;
        while (at > 0 && heap[(at - 1) / 2] > s) {
            heap[at] = heap[(at - 1) / 2];
            at = (at - 1) / 2;
        }
        heap[at] = s;
        return;
    }
    if (!(s > heap[0])) return;
    at = 0; /* the root replaced: sift down */
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= k) break;
        if (child + 1 < k && heap[child + 1] < heap[child]) child++;
        if (!(heap[child] < s)) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = s;
}

#if HAVE_AVX2_BUILD
/* Offers the row 8 values at a time once the heap is full, skipping the eights all below its root (most). */
AVX2 static Py_ssize_t heap_offer_avx2(const float *row, Py_ssize_t vocab, float temperature, Py_ssize_t k, float *heap,
                                       Py_ssize_t *size) {
    Py_ssize_t v = 0;
    for (; v < vocab && *size < k; v++) heap_offer(heap, size, k, row[v] / temperature);
    const __m256 divisor = _mm256_set1_ps(temperature);
    for (; v + 8 <= vocab; v += 8) {
        __m256 s = _mm256_div_ps(_mm256_loadu_ps(row + v), divisor);
        if (!_mm256_movemask_ps(_mm256_cmp_ps(s, _mm256_set1_ps(heap[0]), _CMP_GT_OQ))) continue;
        float values[8];
        _mm256_storeu_ps(values, s);
        for (int i = 0; i < 8; i++) heap_offer(heap, size, k, values[i]);
    }
    return v;
}
#endif

/* The k-th largest of the row's values at the temperature (counted with their repeats), k <= vocab, by a
 * min-heap of the k largest seen (``heap``: room for k). */
static float kth_largest(const float *row, Py_ssize_t vocab, float temperature, Py_ssize_t k, float *heap, int loop) {
    Py_ssize_t size = 0, v = 0;
#if HAVE_AVX2_BUILD
    if (loop >= LOOP_AVX2) v = heap_offer_avx2(row, vocab, temperature, k, heap, &size);
#endif
    for (; v < vocab; v++) heap_offer(heap, &size, k, row[v] / temperature);
    return heap[0];
}

struct mass_sums {
    double total, before; /* e^(s − own) over the kept tokens, and over those before the token */
    int64_t above;        /* tokens of a larger logit */
    int flawed;           /* a NaN or +inf, or a logit 87 above the token's (its e^ would not hold) */
};

/* The sums over one row: the reference, and the path of CPUs without AVX2. */
static void mass_sums_plain(const float *row, Py_ssize_t vocab, float temperature, float own, int64_t token, float kth,
                            struct mass_sums *sums) {
    for (Py_ssize_t v = 0; v < vocab; v++) {
        float s = row[v] / temperature;
        sums->flawed |= s != s || s - own > 87.0f; /* +inf − own is above 87 too */
        sums->above += s > own;
        float e = s > -INFINITY ? exp_clamped(s - own) : 0.0f;
        sums->total += s >= kth ? (double)e : 0.0;
        sums->before += (s > own) || (s == own && v < token) ? (double)e : 0.0;
    }
}

#if HAVE_AVX2_BUILD
/* e^y of 8 values, as exp_clamped (rounding t to the nearest even integer instead: the same accuracy). */
AVX2 static inline __m256 exp_clamped8(__m256 y) {
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(87.0f));
    __m256 t = _mm256_mul_ps(y, _mm256_set1_ps(1.44269504088896341f));
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(1.525273380405984e-05f);
    static const float terms[] = {1.5403530393381608e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                                  5.550410866482158e-02f,  2.402265069591007e-01f,  6.931471805599453e-01f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(terms[i]));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* The sums 8 tokens at a time (the tail plainly); float32 terms, float64 sums, as the plain loop. */
AVX2 static void mass_sums_avx2(const float *row, Py_ssize_t vocab, float temperature, float own, int64_t token,
                                float kth, struct mass_sums *sums) {
    const __m256 divisor = _mm256_set1_ps(temperature), mine = _mm256_set1_ps(own), bound = _mm256_set1_ps(kth);
    const __m256 limit = _mm256_set1_ps(87.0f), none = _mm256_set1_ps(-INFINITY);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256d total_low = _mm256_setzero_pd(), total_high = _mm256_setzero_pd();
    __m256d before_low = _mm256_setzero_pd(), before_high = _mm256_setzero_pd();
    __m256i above = _mm256_setzero_si256();
    __m256 flawed = _mm256_setzero_ps();
    int32_t last = token < INT32_MAX ? (int32_t)token : INT32_MAX; /* vocab fits an int32 (below) */
    Py_ssize_t v = 0;
    const int divide = temperature != 1.0f;
    for (; v + 8 <= vocab; v += 8) {
        __m256 s = _mm256_loadu_ps(row + v);
        if (divide) s = _mm256_div_ps(s, divisor); /* x / 1 is x */
        __m256 d = _mm256_sub_ps(s, mine);
        flawed = _mm256_or_ps(flawed, _mm256_or_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q), _mm256_cmp_ps(d, limit, _CMP_GT_OQ)));
        __m256 larger = _mm256_cmp_ps(s, mine, _CMP_GT_OQ);
        above = _mm256_sub_epi32(above, _mm256_castps_si256(larger));
        __m256i ids = _mm256_add_epi32(_mm256_set1_epi32((int32_t)v), lanes);
        __m256 earlier = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(last), ids));
        __m256 before = _mm256_or_ps(larger, _mm256_and_ps(_mm256_cmp_ps(s, mine, _CMP_EQ_OQ), earlier));
        __m256 e = _mm256_and_ps(exp_clamped8(d), _mm256_cmp_ps(s, none, _CMP_GT_OQ));
        __m256 kept = _mm256_and_ps(e, _mm256_cmp_ps(s, bound, _CMP_GE_OQ));
        __m256 ahead = _mm256_and_ps(e, before);
        total_low = _mm256_add_pd(total_low, _mm256_cvtps_pd(_mm256_castps256_ps128(kept)));
        total_high = _mm256_add_pd(total_high, _mm256_cvtps_pd(_mm256_extractf128_ps(kept, 1)));
        before_low = _mm256_add_pd(before_low, _mm256_cvtps_pd(_mm256_castps256_ps128(ahead)));
        before_high = _mm256_add_pd(before_high, _mm256_cvtps_pd(_mm256_extractf128_ps(ahead, 1)));
    }
    double totals[4], befores[4];
    int32_t counts[8];
    _mm256_storeu_pd(totals, _mm256_add_pd(total_low, total_high));
    _mm256_storeu_pd(befores, _mm256_add_pd(before_low, before_high));
    _mm256_storeu_si256((__m256i *)counts, above);
    for (int i = 0; i < 4; i++) sums->total += totals[i], sums->before += befores[i];
    for (int i = 0; i < 8; i++) sums->above += counts[i];
    sums->flawed |= _mm256_movemask_ps(flawed) != 0;
    mass_sums_plain(row + v, vocab - v, temperature, own, token - v, kth, sums);
}
#endif

#if HAVE_AVX2_BUILD
/* e^y of 16 values, as exp_clamped8. */
KEYED_AVX512 static inline __m512 exp_clamped16(__m512 y) {
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(87.0f));
    __m512 t = _mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
    static const float terms[] = {1.5403530393381608e-04f, 1.3333558146428443e-03f, 9.618129107628477e-03f,
                                  5.550410866482158e-02f,  2.402265069591007e-01f,  6.931471805599453e-01f, 1.0f};
    for (int i = 0; i < 7; i++) p = _mm512_add_ps(_mm512_mul_ps(p, f), _mm512_set1_ps(terms[i]));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* The sums 16 tokens at a time, as mass_sums_avx2 (masks for the selections; the division skipped at t = 1,
 * where x / 1 is x). */
KEYED_AVX512 static void mass_sums_avx512(const float *row, Py_ssize_t vocab, float temperature, float own,
                                          int64_t token, float kth, struct mass_sums *sums) {
    const __m512 divisor = _mm512_set1_ps(temperature), mine = _mm512_set1_ps(own), bound = _mm512_set1_ps(kth);
    const __m512 limit = _mm512_set1_ps(87.0f), none = _mm512_set1_ps(-INFINITY);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int divide = temperature != 1.0f;
    __m512d total_low = _mm512_setzero_pd(), total_high = _mm512_setzero_pd();
    __m512d before_low = _mm512_setzero_pd(), before_high = _mm512_setzero_pd();
    __m512i above = _mm512_setzero_si512();
    __mmask16 flawed = 0;
    int32_t last = token < INT32_MAX ? (int32_t)token : INT32_MAX;
    Py_ssize_t v = 0;
    for (; v + 16 <= vocab; v += 16) {
        __m512 s = _mm512_loadu_ps(row + v);
        if (divide) s = _mm512_div_ps(s, divisor);
        __m512 d = _mm512_sub_ps(s, mine);
        flawed |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(d, limit, _CMP_GT_OQ);
        __mmask16 larger = _mm512_cmp_ps_mask(s, mine, _CMP_GT_OQ);
        above = _mm512_mask_sub_epi32(above, larger, above, _mm512_set1_epi32(-1));
        __mmask16 earlier = _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(last),
                                                    _mm512_add_epi32(_mm512_set1_epi32((int32_t)v), lanes));
        __mmask16 before = larger | (_mm512_cmp_ps_mask(s, mine, _CMP_EQ_OQ) & earlier);
        __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, none, _CMP_GT_OQ), exp_clamped16(d));
        __m512 kept = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, bound, _CMP_GE_OQ), e);
        __m512 ahead = _mm512_maskz_mov_ps(before, e);
        total_low = _mm512_add_pd(total_low, _mm512_cvtps_pd(_mm512_castps512_ps256(kept)));
        total_high = _mm512_add_pd(total_high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(kept), 1))));
        before_low = _mm512_add_pd(before_low, _mm512_cvtps_pd(_mm512_castps512_ps256(ahead)));
        before_high = _mm512_add_pd(before_high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(ahead), 1))));
    }
    sums->total += _mm512_reduce_add_pd(_mm512_add_pd(total_low, total_high));
    sums->before += _mm512_reduce_add_pd(_mm512_add_pd(before_low, before_high));
    sums->above += _mm512_reduce_add_epi32(above);
    sums->flawed |= flawed != 0;
    mass_sums_plain(row + v, vocab - v, temperature, own, token - v, kth, sums);
}
#endif

/* The sums by ``loop``. */
static void mass_sums(const float *row, Py_ssize_t vocab, float temperature, float own, int64_t token, float kth,
                      int loop, struct mass_sums *sums) {
    *sums = (struct mass_sums){0.0, 0.0, 0, 0};
#if HAVE_AVX2_BUILD
    if (vocab < INT32_MAX && loop >= LOOP_AVX512) {
        mass_sums_avx512(row, vocab, temperature, own, token, kth, sums);
        return;
    }
    if (vocab < INT32_MAX && loop >= LOOP_AVX2) {
        mass_sums_avx2(row, vocab, temperature, own, token, kth, sums);
        return;
    }
#endif
    mass_sums_plain(row, vocab, temperature, own, token, kth, sums);
}

/* The mass before ``token`` in the row's filtered distribution (see above), NaN where the row holds a NaN or
 * +inf, the token is outside the vocabulary or −inf, or top-k drops it; 0 where top-k keeps it and there is
 * no nucleus to look at. ``heap``: room for top_k floats (top_k 0: no top-k). */
static double row_mass_before(const float *row, Py_ssize_t vocab, int64_t token, float temperature, Py_ssize_t top_k,
                              int nucleus, float *heap, int loop) {
    if (token < 0 || token >= vocab) return NAN;
    float own = row[token] / temperature;
    if (!(own > -INFINITY && own < INFINITY)) return NAN;
    float kth = top_k > 0 && nucleus ? kth_largest(row, vocab, temperature, top_k, heap, loop) : -INFINITY;
    struct mass_sums sums;
    mass_sums(row, vocab, temperature, own, token, kth, loop, &sums);
    if (sums.flawed || (top_k > 0 && sums.above >= top_k)) return NAN;
    return nucleus ? sums.before / sums.total : 0.0;
}

/* ---- a greedy draft step's token and confidence ------------------------------------------------------------
 *
 * A greedy draft step keeps its row's first maximum and the policy's confidence in it, the largest softmax
 * probability at temperature 1: 1 / Σ_j e^(x_j − max). Numpy took five calls for it (argmax, min, a
 * difference, exp, sum), each cold after the target's pass had swept the caches, and two arrays a step; here
 * it is one read of the row. The terms are float32 (exp_clamped8's arithmetic, the plain loop rounding t to the
 * nearest integer, ties to even, as the vector loops do), summed in float64 into eight lanes by the index modulo 8 and
 * the lanes added in a fixed order, so every loop gives the same bits. */

/* exp_clamped8's e^y of one value (y <= 0 here: a logit less the row's maximum). */
static inline float exp_clamped_even(float y) {
    y = y > -87.0f ? y : -87.0f;
    y = y < 87.0f ? y : 87.0f;
    float t = y * 1.44269504088896341f;
    /* t's nearest integer, ties to even, as _mm256_round_ps's: 1.5 * 2^23 + t has no bits below the units for
     * |t| < 2^22 (here |t| < 126), so the sum rounds t under the default rounding and the difference is exact.
     * Not nearbyintf: a call into libm every entry at the baseline ISA, which kept the loop scalar (5x slower). */
    float n = (t + 0x1.8p23f) - 0x1.8p23f;
    return exp2_split(t - n, (int)n);
}

/* Σ e^(x_v − top) for v in [from, vocab) into lanes[v mod 8]; *minus_inf set where an entry is −inf. The
 * reference, the path of CPUs without AVX2 and every loop's tail. */
static void softmax_lanes_plain(const float *row, Py_ssize_t from, Py_ssize_t vocab, float top, double lanes[8],
                                int *minus_inf) {
    for (Py_ssize_t v = from; v < vocab; v++) {
        *minus_inf |= row[v] == -INFINITY;
        lanes[v & 7] += (double)exp_clamped_even(row[v] - top);
    }
}

#if HAVE_AVX2_BUILD
/* The same sums 8 entries at a time (lane j takes entry v + j, as the plain loop's v mod 8); returns where
 * the plain tail starts. */
AVX2 static Py_ssize_t softmax_lanes_avx2(const float *row, Py_ssize_t vocab, float top, double lanes[8],
                                          int *minus_inf) {
    const __m256 shift = _mm256_set1_ps(top), none = _mm256_set1_ps(-INFINITY);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    __m256 infinite = _mm256_setzero_ps();
    Py_ssize_t v = 0;
    for (; v + 8 <= vocab; v += 8) {
        __m256 x = _mm256_loadu_ps(row + v);
        infinite = _mm256_or_ps(infinite, _mm256_cmp_ps(x, none, _CMP_EQ_OQ));
        __m256 e = exp_clamped8(_mm256_sub_ps(x, shift));
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    _mm256_storeu_pd(lanes, low);
    _mm256_storeu_pd(lanes + 4, high);
    *minus_inf |= _mm256_movemask_ps(infinite) != 0;
    return v;
}
#endif

/* The row's first maximum in *index and 1 / Σ e^(x − max) in *probability; 0 where the row holds a NaN or an
 * infinity (nothing set). */
static int row_top_choice(const float *row, Py_ssize_t vocab, int loop, int64_t *index, double *probability) {
    float top = 0.0f;
    int64_t first;
#if HAVE_AVX2_BUILD
    if (loop == LOOP_AVX512) first = row_top_avx512(row, vocab, &top);
    else if (loop == LOOP_AVX2) first = row_top_avx2(row, vocab, &top);
    else
#endif
        first = keyed_first_max_plain(row, vocab, &top);
    if (first < 0 || !(top > -INFINITY && top < INFINITY)) return 0; /* a NaN; +inf (or every entry −inf) */
    double lanes[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int minus_inf = 0;
    Py_ssize_t v = 0;
#if HAVE_AVX2_BUILD
    if (loop >= LOOP_AVX2) v = softmax_lanes_avx2(row, vocab, top, lanes, &minus_inf);
#endif
    softmax_lanes_plain(row, v, vocab, top, lanes, &minus_inf);
    if (minus_inf) return 0;
    *index = first;
    *probability = 1.0 / (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7])));
    return 1;
}

static PyObject *py_top_choice(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "vocab", "loop", NULL};
    PyObject *x_address;
    Py_ssize_t vocab;
    int loop;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oni", names, &x_address, &vocab, &loop)) return NULL;
    if (vocab < 1) return PyErr_Format(PyExc_ValueError, "vocab %zd: expected at least 1", vocab);
    if (!loop_usable(loop)) return NULL;
    const float *x = PyLong_AsVoidPtr(x_address);
    if (PyErr_Occurred()) return NULL;
    if (!x) return PyErr_Format(PyExc_ValueError, "x must be a non-null address");
    int64_t index = -1;
    double probability = 0.0;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    finite = row_top_choice(x, vocab, loop, &index, &probability);
    Py_END_ALLOW_THREADS
    if (!finite) Py_RETURN_NONE;
    return Py_BuildValue("(Ld)", (long long)index, probability);
}

static PyObject *py_mass_before(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "table_rows", "vocab", "stride", "rows", "tokens", "temperature", "top_k", "nucleus",
                            "loop", NULL};
    PyObject *x_address, *rows_arg, *tokens_arg;
    Py_ssize_t table_rows, vocab, stride, top_k;
    double temperature;
    int nucleus, loop;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OnnnOOdnpi", names, &x_address, &table_rows, &vocab, &stride, &rows_arg,
                                     &tokens_arg, &temperature, &top_k, &nucleus, &loop))
        return NULL;
    if (!loop_usable(loop)) return NULL;
    if (table_rows < 0 || vocab < 1 || stride < 0 || top_k < 0 || top_k > vocab)
        return PyErr_Format(PyExc_ValueError, "table_rows %zd, vocab %zd, stride %zd, top_k %zd: expected table_rows >= 0, "
                            "vocab >= 1, stride >= 0, 0 <= top_k <= vocab", table_rows, vocab, stride, top_k);
    if (!(temperature > 0.0) || !isfinite(temperature) || !isfinite((float)temperature))
        return PyErr_Format(PyExc_ValueError, "temperature must be a finite number > 0, got %g", temperature);
    const float *x = PyLong_AsVoidPtr(x_address);
    if (PyErr_Occurred()) return NULL;
    PyObject *rows_seq = PySequence_Tuple(rows_arg), *tokens_seq = NULL, *result = NULL;
    uint64_t *rows = NULL;
    int64_t *tokens = NULL;
    double *masses = NULL;
    float *heap = NULL;
    if (!rows_seq) return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(rows_seq);
    tokens_seq = PySequence_Tuple(tokens_arg);
    if (!tokens_seq) goto done;
    if (PyTuple_GET_SIZE(tokens_seq) != count) {
        PyErr_Format(PyExc_ValueError, "%zd rows need %zd tokens, got %zd", count, count, PyTuple_GET_SIZE(tokens_seq));
        goto done;
    }
    if (count == 0) {
        result = PyList_New(0);
        goto done;
    }
    if (!x) {
        PyErr_Format(PyExc_ValueError, "x must be a non-null address");
        goto done;
    }
    rows = PyMem_Malloc((size_t)count * sizeof *rows);
    tokens = PyMem_Malloc((size_t)count * sizeof *tokens);
    masses = PyMem_Malloc((size_t)count * sizeof *masses);
    heap = top_k > 0 && nucleus ? PyMem_Malloc((size_t)top_k * sizeof *heap) : NULL;
    if (!rows || !tokens || !masses || (top_k > 0 && nucleus && !heap)) {
        PyErr_NoMemory();
        goto done;
    }
    if (!read_ints(rows_seq, count, rows, 0, table_rows)) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyNumber_Index(PyTuple_GET_ITEM(tokens_seq, i));
        if (!item) goto done;
        int overflow = 0;
        long long token = PyLong_AsLongLongAndOverflow(item, &overflow);
        Py_DECREF(item);
        if (token == -1 && PyErr_Occurred()) goto done;
        tokens[i] = overflow ? -1 : (int64_t)token; /* beyond a long long: outside the vocabulary, NaN */
    }
    float t = (float)temperature; /* as torch divides a float32 row by a Python number */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++)
        masses[i] = row_mass_before(x + (size_t)rows[i] * (size_t)stride, vocab, tokens[i], t, top_k, nucleus, heap, loop);
    Py_END_ALLOW_THREADS
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result && i < count; i++) {
        PyObject *mass = PyFloat_FromDouble(masses[i]);
        if (!mass) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, mass);
    }
done:
    PyMem_Free(rows);
    PyMem_Free(tokens);
    PyMem_Free(masses);
    PyMem_Free(heap);
    Py_XDECREF(rows_seq);
    Py_XDECREF(tokens_seq);
    return result;
}

static PyObject *py_mix64(PyObject *self, PyObject *arg) {
    (void)self;
    uint64_t z = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(keyed_mix64(z));
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
    {"mass_before", (PyCFunction)(void (*)(void))py_mass_before, METH_VARARGS | METH_KEYWORDS,
     "mass_before(x, table_rows, vocab, stride, rows, tokens, temperature, top_k, nucleus, loop) -> list: for each chosen "
     "row of the float32 table at x and its token, the probability mass before the token at the temperature (the "
     "tokens of a larger logit, or an equal one and a smaller id; under top_k > 0 in the softmax of the tokens "
     "not below the k-th largest logit), 0.0 without nucleus; NaN for a row holding a NaN or +inf, a token "
     "outside the vocabulary, at -inf or 87 below another logit, or one top_k drops; loop: 0 plain, 1 AVX2, "
     "2 AVX-512 (sums within a float's "
     "rounding of each other). IndexError for a row outside the table."},
    {"top_choice", (PyCFunction)(void (*)(void))py_top_choice, METH_VARARGS | METH_KEYWORDS,
     "top_choice(x, vocab, loop) -> (index, probability) | None: the first maximum of the float32 row at x [vocab] "
     "and its softmax probability at temperature 1, 1 / sum_j exp(x_j - max) (float32 terms within a few ulps, "
     "float64 sums; the same bits on every loop); None where the row holds a NaN or an infinity."},
    {"mix64", py_mix64, METH_O, "SplitMix64's output function of a 64-bit word."},
    {"best_loop", py_best_loop, METH_NOARGS, "The fastest loop this CPU runs: 0 plain, 1 AVX2, 2 AVX-512 (the same bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_keyed_noise",
                                    .m_doc = "Keyed Gumbel noise for sampling (tierspec/csrc/noise).", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__keyed_noise(void) { return PyModule_Create(&module); }
