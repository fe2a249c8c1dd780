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
    {"mix64", py_mix64, METH_O, "SplitMix64's output function of a 64-bit word."},
    {"best_loop", py_best_loop, METH_NOARGS, "The fastest loop this CPU runs: 0 plain, 1 AVX2, 2 AVX-512 (the same bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_keyed_noise",
                                    .m_doc = "Keyed Gumbel noise for sampling (tierspec/csrc/noise).", .m_size = -1,
                                    .m_methods = methods};

PyMODINIT_FUNC PyInit__keyed_noise(void) { return PyModule_Create(&module); }
