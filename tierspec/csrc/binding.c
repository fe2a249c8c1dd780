/* The Python module ``tierspec._qengine``: weights, layers and stacks as capsules that own (or keep
 * alive) what the engine reads, and calls with named arguments (tierspec/engine.py wraps them for
 * torch tensors). Buffers are passed as addresses; every count, index and shape the C side can check
 * is checked here, before the GIL is released, with a one-line ValueError. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#define WEIGHT_CAPSULE "tierspec.weight"
#define LAYER_CAPSULE "tierspec.layer"
#define STACK_CAPSULE "tierspec.stack"

static void *address(PyObject *value, const char *name) { /* an int address, or NULL with an error set */
    void *p = PyLong_AsVoidPtr(value);
    if (p == NULL && !PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s is a null address", name);
    return p;
}

/* ---- weights ---------------------------------------------------------------------------------- */

static void weight_free(PyObject *capsule) {
    packed_weight *w = PyCapsule_GetPointer(capsule, WEIGHT_CAPSULE);
    if (!w) return;
    Py_XDECREF((PyObject *)PyCapsule_GetContext(capsule)); /* a stacked weight's parts */
    free(w->cells);
    free(w);
}

static packed_weight *weight_of(PyObject *capsule) { return PyCapsule_GetPointer(capsule, WEIGHT_CAPSULE); }

static PyObject *new_weight_capsule(int ggml_type, int kind, int layout, int round_rows, int N, int K) {
    packed_weight *w = calloc(1, sizeof *w);
    if (!w) return PyErr_NoMemory();
    *w = (packed_weight){ggml_type, kind, layout, round_rows, N, K, NULL, packed_bytes(kind, N, K)};
    w->cells = aligned_alloc(64, (w->bytes + 63) & ~(size_t)63);
    if (!w->cells) {
        free(w);
        return PyErr_NoMemory();
    }
    memset(w->cells, 0, w->bytes);
    PyObject *capsule = PyCapsule_New(w, WEIGHT_CAPSULE, weight_free);
    if (!capsule) {
        free(w->cells);
        free(w);
    }
    return capsule;
}

static PyObject *py_new_weight(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"ggml_type", "layout", "round_rows", "out_features", "in_features", NULL};
    int type, layout, round_rows, N, K;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iipii", names, &type, &layout, &round_rows, &N, &K)) return NULL;
    const block_type *bt = find_block_type(type);
    if (!bt) return PyErr_Format(PyExc_ValueError, "ggml type %d is not computed natively", type);
    if (layout < 0 || layout >= LAYOUTS) return PyErr_Format(PyExc_ValueError, "layout %d is not one of 0..%d", layout, LAYOUTS - 1);
    if (N < 1 || K < bt->inputs || K % bt->inputs)
        return PyErr_Format(PyExc_ValueError, "a %s weight needs rows of whole blocks of %d, not [%d, %d]", bt->name, bt->inputs, N, K);
    return new_weight_capsule(type, bt->kind, layout, round_rows && layout == LAYOUT_F32, N, K);
}

/* stack_weights(parts): one weight of the parts' rows in order (parts of different kinds; matmul.c
 * prepares the rows once for all of them). The new capsule keeps the parts alive. */
static PyObject *py_stack_weights(PyObject *self, PyObject *parts) {
    (void)self;
    if (!PyTuple_Check(parts) || PyTuple_GET_SIZE(parts) < 2 || PyTuple_GET_SIZE(parts) > MAX_PARTS)
        return PyErr_Format(PyExc_ValueError, "a stacked weight takes a tuple of 2 to %d weights", MAX_PARTS);
    packed_weight stacked = {-1, -1, 0, 0, 0, 0, NULL, 0};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(parts); i++) {
        packed_weight *part = weight_of(PyTuple_GET_ITEM(parts, i));
        if (!part) return NULL;
        if (part->parts) return PyErr_Format(PyExc_ValueError, "part %zd is itself stacked", i);
        if (i == 0) stacked.layout = part->layout, stacked.round_rows = part->round_rows, stacked.K = part->K;
        if (part->layout != stacked.layout || part->round_rows != stacked.round_rows || part->K != stacked.K)
            return PyErr_Format(PyExc_ValueError, "part %zd's inputs (%d, layout %d) differ from the first part's (%d, layout %d)",
                                i, part->K, part->layout, stacked.K, stacked.layout);
        stacked.part[i] = part;
        stacked.part_row0[i] = stacked.N;
        stacked.N += part->N;
        stacked.bytes += part->bytes;
    }
    stacked.parts = (int)PyTuple_GET_SIZE(parts);
    packed_weight *w = malloc(sizeof *w);
    if (!w) return PyErr_NoMemory();
    *w = stacked;
    PyObject *capsule = PyCapsule_New(w, WEIGHT_CAPSULE, weight_free);
    if (!capsule) {
        free(w);
        return NULL;
    }
    Py_INCREF(parts);
    if (PyCapsule_SetContext(capsule, parts) != 0) {
        Py_DECREF(parts);
        Py_DECREF(capsule);
        return NULL;
    }
    return capsule;
}

/* one_thread_rows(weight[, rows]): products of the weight over ``rows`` rows or fewer run on one
 * thread (None: the ISA's default again); returns the setting in force (an int). */
static PyObject *py_one_thread_rows(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"weight", "rows", NULL};
    PyObject *capsule, *rows_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O", names, &capsule, &rows_o)) return NULL;
    packed_weight *w = weight_of(capsule);
    if (!w) return NULL;
    if (rows_o == Py_None) {
        w->one_thread_rows_set = 0;
    } else if (rows_o) {
        long rows = PyLong_AsLong(rows_o);
        if (rows == -1 && PyErr_Occurred()) return NULL;
        if (rows < 0 || rows > 64)
            return PyErr_Format(PyExc_ValueError, "one-thread rows are 0 .. 64 (or None: the default), not %ld", rows);
        w->one_thread_rows = (int)rows;
        w->one_thread_rows_set = 1;
    }
    return PyLong_FromLong(one_thread_rows(w));
}

static PyObject *py_weight_bytes(PyObject *self, PyObject *capsule) {
    (void)self;
    packed_weight *w = weight_of(capsule);
    return w ? PyLong_FromSize_t(w->bytes) : NULL;
}

static PyObject *py_repack(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"weight", "blocks", "rows", "order", "row0", NULL};
    PyObject *capsule, *blocks, *order = Py_None;
    int rows, row0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOiOi", names, &capsule, &blocks, &rows, &order, &row0)) return NULL;
    packed_weight *w = weight_of(capsule);
    if (!w) return NULL;
    const uint8_t *src = address(blocks, "blocks");
    if (!src) return NULL;
    const int64_t *rank = NULL;
    if (order != Py_None && !(rank = address(order, "order"))) return NULL;
    if (w->parts) return PyErr_Format(PyExc_ValueError, "a stacked weight is repacked part by part, before stacking");
    if (rows < 0 || row0 < 0 || row0 + rows > w->N)
        return PyErr_Format(PyExc_ValueError, "rows %d .. %d are outside the weight's %d rows", row0, row0 + rows - 1, w->N);
    Py_BEGIN_ALLOW_THREADS
    repack(w, find_block_type(w->ggml_type), src, rank, rows, row0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int check_rows(const packed_weight *w, const int64_t *rows, int count) {
    for (int i = 0; i < count; i++)
        if (rows[i] < 0 || rows[i] >= w->N) {
            PyErr_Format(PyExc_IndexError, "row index %lld is outside 0..%d", (long long)rows[i], w->N - 1);
            return 0;
        }
    return 1;
}

static PyObject *py_dequant_rows(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"weight", "indices", "count", "out", NULL};
    PyObject *capsule, *indices, *target;
    int count;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOiO", names, &capsule, &indices, &count, &target)) return NULL;
    packed_weight *w = weight_of(capsule);
    if (!w) return NULL;
    if (count <= 0) Py_RETURN_NONE;
    const int64_t *rows = address(indices, "indices");
    float *out = rows ? address(target, "out") : NULL;
    if (!out || !check_rows(w, rows, count)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    dequant_rows(w, rows, count, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gather_rows(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"weight", "indices", "count", NULL};
    PyObject *capsule, *indices;
    int count;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOi", names, &capsule, &indices, &count)) return NULL;
    packed_weight *w = weight_of(capsule);
    if (!w) return NULL;
    if (count < 1) return PyErr_Format(PyExc_ValueError, "a gathered weight needs one row at least");
    if (w->parts) return PyErr_Format(PyExc_ValueError, "rows are gathered from a weight of one type, not a stacked one");
    const int64_t *rows = address(indices, "indices");
    if (!rows || !check_rows(w, rows, count)) return NULL;
    PyObject *out = new_weight_capsule(w->ggml_type, w->kind, w->layout, w->round_rows, count, w->K);
    if (!out) return NULL;
    packed_weight *dst = weight_of(out);
    Py_BEGIN_ALLOW_THREADS
    gather_rows(w, rows, count, dst);
    Py_END_ALLOW_THREADS
    return out;
}

/* Row m's key and temperature from ``keys`` and ``temperatures`` (sequences of ``rows`` entries; a key of None:
 * the row is not drawn) into the draws' arrays; 0 after setting a Python error. */
static int read_draws(PyObject *keys_arg, PyObject *temperatures_arg, int rows, uint64_t *keys, float *temperature,
                      uint8_t *keyed) {
    PyObject *keys_seq = PySequence_Fast(keys_arg, "keys must be a sequence of ints or None, one per row");
    if (!keys_seq) return 0;
    PyObject *temperatures_seq = PySequence_Fast(temperatures_arg, "temperatures must be a sequence of floats, one per row");
    int ok = 0;
    if (!temperatures_seq) goto done;
    if (PySequence_Fast_GET_SIZE(keys_seq) != rows || PySequence_Fast_GET_SIZE(temperatures_seq) != rows) {
        PyErr_Format(PyExc_ValueError, "%d rows need %d keys and temperatures, got %zd and %zd", rows, rows,
                     PySequence_Fast_GET_SIZE(keys_seq), PySequence_Fast_GET_SIZE(temperatures_seq));
        goto done;
    }
    for (int m = 0; m < rows; m++) {
        PyObject *key = PySequence_Fast_GET_ITEM(keys_seq, m);
        keyed[m] = key != Py_None;
        keys[m] = 0, temperature[m] = 1.0f;
        if (!keyed[m]) continue;
        keys[m] = PyLong_AsUnsignedLongLong(key);
        if (PyErr_Occurred()) goto done;
        double t = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(temperatures_seq, m));
        if (t == -1.0 && PyErr_Occurred()) goto done;
        temperature[m] = (float)t; /* as torch takes a Python float for a float32 row */
        if (!(temperature[m] > 0.0f) || !isfinite(temperature[m])) {
            PyErr_Format(PyExc_ValueError, "row %d's temperature %g is not a finite number above 0", m, t);
            goto done;
        }
        /* the engine's threads read a subnormal as 0 (denormals flushed): such a row is left to the extension */
        if (temperature[m] < FLT_MIN) keyed[m] = 0;
    }
    ok = 1;
done:
    Py_DECREF(keys_seq);
    Py_XDECREF(temperatures_seq);
    return ok;
}

static PyObject *int_list(const int64_t *values, int count) {
    PyObject *list = PyList_New(count);
    for (int m = 0; list && m < count; m++) {
        PyObject *item = PyLong_FromLongLong(values[m]);
        if (!item) Py_CLEAR(list);
        else PyList_SET_ITEM(list, m, item);
    }
    return list;
}

static PyObject *py_matmul(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"weight", "x", "rows", "out", "out_stride", "accumulate", "threads", "maxima", "keys",
                            "temperatures", NULL};
    PyObject *capsule, *xo, *outo, *keys_arg = Py_None, *temperatures_arg = Py_None;
    int rows, ldo, accumulate, threads, want_maxima = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOiOipi|pOO", names, &capsule, &xo, &rows, &outo, &ldo, &accumulate,
                                     &threads, &want_maxima, &keys_arg, &temperatures_arg))
        return NULL;
    int want_draws = keys_arg != Py_None;
    if (want_draws && (!want_maxima || temperatures_arg == Py_None))
        return PyErr_Format(PyExc_ValueError, "keyed draws come with the product's maxima and need the rows' "
                            "temperatures");
    packed_weight *w = weight_of(capsule);
    if (!w) return NULL;
    if (rows <= 0)
        return want_draws ? Py_BuildValue("(NN)", PyList_New(0), PyList_New(0))
                          : want_maxima ? PyList_New(0) : Py_NewRef(Py_None);
    const float *x = address(xo, "x");
    float *out = x ? address(outo, "out") : NULL;
    if (!out) return NULL;
    if (ldo < w->N) return PyErr_Format(PyExc_ValueError, "an output stride of %d cannot hold %d outputs a row", ldo, w->N);
    /* per row: maxima and draws (int64), keys (uint64), temperature (float), keyed (byte) */
    size_t per_row = 3 * sizeof(int64_t) + sizeof(float) + 1;
    int64_t local[64 * 4]; /* 64 rows' worth (32 bytes a row), aligned for the int64 arrays */
    char *mem = (char *)local;
    if (rows > 64 && !(mem = PyMem_Malloc((size_t)rows * per_row))) return PyErr_NoMemory();
    int64_t *maxima = want_maxima ? (int64_t *)mem : NULL, *tokens = (int64_t *)mem + rows;
    uint64_t *keys = (uint64_t *)((int64_t *)mem + 2 * rows);
    float *temperature = (float *)(keys + rows);
    uint8_t *keyed = (uint8_t *)(temperature + rows);
    row_draws draws = {keys, temperature, keyed};
    PyObject *result = NULL;
    if (want_draws && !read_draws(keys_arg, temperatures_arg, rows, keys, temperature, keyed)) goto done;
    Py_BEGIN_ALLOW_THREADS
    unsigned csr = flush_denormals();
    if (want_draws) linear_draws(w, x, rows, out, ldo, accumulate, threads, maxima, &draws, tokens);
    else linear_maxima(w, x, rows, out, ldo, accumulate, threads, maxima);
    restore_denormals(csr);
    Py_END_ALLOW_THREADS
    if (want_draws) {
        PyObject *found = int_list(maxima, rows), *drawn = found ? int_list(tokens, rows) : NULL;
        result = drawn ? PyTuple_Pack(2, found, drawn) : NULL;
        Py_XDECREF(found);
        Py_XDECREF(drawn);
    } else result = want_maxima ? int_list(maxima, rows) : Py_NewRef(Py_None);
done:
    if (mem != (char *)local) PyMem_Free(mem);
    return result;
}

/* ---- layers and stacks ------------------------------------------------------------------------ */

typedef struct {
    layer_desc desc;
    PyObject *weights[4]; /* the capsules desc's products point into */
} layer_object;

static void free_layer_vectors(layer_desc *d) {
    free(d->norm_in);
    free(d->norm_post);
    free(d->qkv_bias);
    free(d->q_norm);
    free(d->k_norm);
    free(d->attention_out_norm);
    free(d->mlp_out_norm);
}

static void layer_free(PyObject *capsule) {
    layer_object *L = PyCapsule_GetPointer(capsule, LAYER_CAPSULE);
    if (!L) return;
    for (int i = 0; i < 4; i++) Py_XDECREF(L->weights[i]);
    free_layer_vectors(&L->desc);
    free(L);
}

/* A copy of ``size`` float32 values from a buffer (a norm's or a bias's), or NULL with an error set;
 * None gives NULL with no error where ``optional``. */
static int copy_vector(PyObject *source, int size, const char *name, int optional, float **out) {
    *out = NULL;
    if (source == Py_None && optional) return 1;
    Py_buffer view;
    if (PyObject_GetBuffer(source, &view, PyBUF_C_CONTIGUOUS) != 0) return 0;
    if (view.len != (Py_ssize_t)size * 4) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not %d float32 values", name, view.len, size);
    } else if ((*out = malloc((size_t)size * 4))) {
        memcpy(*out, view.buf, (size_t)size * 4);
    } else {
        PyErr_NoMemory();
    }
    PyBuffer_Release(&view);
    return *out != NULL;
}

static int check_product(const packed_weight *w, const char *name, int N, int K, const packed_weight *first) {
    if (w->N != N || w->K != K) {
        PyErr_Format(PyExc_ValueError, "the layer's %s is [%d, %d], its shapes say [%d, %d]", name, w->N, w->K, N, K);
        return 0;
    }
    if (w->layout != first->layout || w->round_rows != first->round_rows) {
        PyErr_Format(PyExc_ValueError, "the layer's products must share their numerics (%s does not)", name);
        return 0;
    }
    return 1;
}

/* make_layer's keyword-only features beyond Llama's layer (engine.h's layer_desc), each checked. */
static int read_features(layer_desc *d, PyObject *scale, PyObject *softcap, PyObject *rotary_dims, const char *activation) {
    if (strcmp(activation, "silu") == 0) d->activation = ACT_SILU;
    else if (strcmp(activation, "gelu_tanh") == 0) d->activation = ACT_GELU_TANH;
    else {
        PyErr_Format(PyExc_ValueError, "activation %s is not one the engine computes (silu, gelu_tanh)", activation);
        return 0;
    }
    if (d->window < 0) {
        PyErr_Format(PyExc_ValueError, "a sliding window of %d positions (0: none)", d->window);
        return 0;
    }
    if (d->rotary_table < 0 || d->rotary_table >= MAX_ROTARY_TABLES) {
        PyErr_Format(PyExc_ValueError, "rotary table %d is not one of 0..%d", d->rotary_table, MAX_ROTARY_TABLES - 1);
        return 0;
    }
    d->rotary_dims = d->head_dim;
    if (rotary_dims != Py_None) {
        long dims = PyLong_AsLong(rotary_dims);
        if (dims == -1 && PyErr_Occurred()) return 0;
        if (dims < 2 || dims % 2 || dims > d->head_dim) {
            PyErr_Format(PyExc_ValueError, "rotary dimensions %ld for heads of %d (even, 2 .. the head width)", dims, d->head_dim);
            return 0;
        }
        d->rotary_dims = (int)dims;
    }
    d->attention_scale = 1.0f / sqrtf((float)d->head_dim);
    if (scale != Py_None) {
        double value = PyFloat_AsDouble(scale);
        if (value == -1.0 && PyErr_Occurred()) return 0;
        if (!(value > 0.0) || !isfinite(value)) {
            PyErr_Format(PyExc_ValueError, "an attention scale of %R (a positive number)", scale);
            return 0;
        }
        d->attention_scale = (float)value;
    }
    d->softcap = 0.0f;
    if (softcap != Py_None) {
        double value = PyFloat_AsDouble(softcap);
        if (value == -1.0 && PyErr_Occurred()) return 0;
        if (!(value > 0.0) || !isfinite(value)) {
            PyErr_Format(PyExc_ValueError, "an attention soft-cap of %R (a positive number)", softcap);
            return 0;
        }
        d->softcap = (float)value;
    }
    return 1;
}

static PyObject *py_make_layer(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"qkv", "o", "gate_up", "down", "norm_in", "norm_post", "eps",
                            "hidden", "heads", "kv_heads", "head_dim", "inter",
                            "qkv_bias", "q_norm", "k_norm", "attention_out_norm", "mlp_out_norm", "activation",
                            "window", "rotary_table", "rotary_dims", "attention_scale", "softcap", NULL};
    PyObject *caps[4], *norm_in, *norm_post;
    PyObject *qkv_bias = Py_None, *q_norm = Py_None, *k_norm = Py_None, *attention_out_norm = Py_None,
             *mlp_out_norm = Py_None, *rotary_dims = Py_None, *scale = Py_None, *softcap = Py_None;
    const char *activation = "silu";
    double eps;
    int hidden, heads, kv_heads, head_dim, inter, window = 0, rotary_table = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOdiiiii|$OOOOOsiiOOO", names, &caps[0], &caps[1], &caps[2], &caps[3],
                                     &norm_in, &norm_post, &eps, &hidden, &heads, &kv_heads, &head_dim, &inter, &qkv_bias,
                                     &q_norm, &k_norm, &attention_out_norm, &mlp_out_norm, &activation, &window,
                                     &rotary_table, &rotary_dims, &scale, &softcap))
        return NULL;
    packed_weight *w[4];
    for (int i = 0; i < 4; i++)
        if (!(w[i] = weight_of(caps[i]))) return NULL;
    if (hidden < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 2 || head_dim % 2 || head_dim > 512 || inter < 1)
        return PyErr_Format(PyExc_ValueError, "a layer of %d heads over %d kv heads of width %d (even, at most 512) does not fit",
                            heads, kv_heads, head_dim);
    if (!check_product(w[0], "qkv", (heads + 2 * kv_heads) * head_dim, hidden, w[0]) ||
        !check_product(w[1], "o", hidden, heads * head_dim, w[0]) || !check_product(w[2], "gate_up", 2 * inter, hidden, w[0]) ||
        !check_product(w[3], "down", hidden, inter, w[0]))
        return NULL;
    layer_object *L = calloc(1, sizeof *L);
    if (!L) return PyErr_NoMemory();
    layer_desc *d = &L->desc;
    *d = (layer_desc){.qkv = w[0], .o = w[1], .gate_up = w[2], .down = w[3], .eps = (float)eps, .hidden = hidden,
                      .heads = heads, .kv_heads = kv_heads, .head_dim = head_dim, .inter = inter, .window = window,
                      .rotary_table = rotary_table};
    int width = (heads + 2 * kv_heads) * head_dim;
    if (!read_features(d, scale, softcap, rotary_dims, activation) || !copy_vector(norm_in, hidden, "norm_in", 0, &d->norm_in) ||
        !copy_vector(norm_post, hidden, "norm_post", 0, &d->norm_post) ||
        !copy_vector(qkv_bias, width, "qkv_bias", 1, &d->qkv_bias) || !copy_vector(q_norm, head_dim, "q_norm", 1, &d->q_norm) ||
        !copy_vector(k_norm, head_dim, "k_norm", 1, &d->k_norm) ||
        !copy_vector(attention_out_norm, hidden, "attention_out_norm", 1, &d->attention_out_norm) ||
        !copy_vector(mlp_out_norm, hidden, "mlp_out_norm", 1, &d->mlp_out_norm)) {
        free_layer_vectors(d);
        free(L);
        return NULL;
    }
    if ((d->q_norm == NULL) != (d->k_norm == NULL)) {
        free_layer_vectors(d);
        free(L);
        return PyErr_Format(PyExc_ValueError, "a layer normalises both q and k heads or neither");
    }
    for (int i = 0; i < 4; i++) {
        Py_INCREF(caps[i]);
        L->weights[i] = caps[i];
    }
    PyObject *capsule = PyCapsule_New(L, LAYER_CAPSULE, layer_free);
    if (!capsule) {
        for (int i = 0; i < 4; i++) Py_DECREF(caps[i]);
        free_layer_vectors(d);
        free(L);
    }
    return capsule;
}

typedef struct {
    int count;
    const layer_desc **layers;
    PyObject *keep; /* the tuple of layer capsules */
} stack_object;

static void stack_free(PyObject *capsule) {
    stack_object *S = PyCapsule_GetPointer(capsule, STACK_CAPSULE);
    if (!S) return;
    Py_XDECREF(S->keep);
    free(S->layers);
    free(S);
}

static PyObject *py_make_stack(PyObject *self, PyObject *layers) {
    (void)self;
    if (!PyTuple_Check(layers) || PyTuple_GET_SIZE(layers) < 1) {
        PyErr_SetString(PyExc_TypeError, "make_stack takes a tuple of one layer or more");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(layers);
    stack_object *S = calloc(1, sizeof *S);
    if (!S || !(S->layers = calloc((size_t)count, sizeof(layer_desc *)))) {
        free(S);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        layer_object *L = PyCapsule_GetPointer(PyTuple_GET_ITEM(layers, i), LAYER_CAPSULE);
        if (!L) {
            free(S->layers);
            free(S);
            return NULL;
        }
        S->layers[i] = &L->desc;
        if (L->desc.hidden != S->layers[0]->hidden) {
            free(S->layers);
            free(S);
            return PyErr_Format(PyExc_ValueError, "a stack's layers share one hidden width");
        }
    }
    S->count = (int)count;
    Py_INCREF(layers);
    S->keep = layers;
    return PyCapsule_New(S, STACK_CAPSULE, stack_free);
}

/* The columns of run_stack's segment table, one row per sequence (int64). */
enum { SEG_FIRST_ROW, SEG_ROWS, SEG_START, SEG_KV, SEG_ATTENDS, SEG_EVERY_SLOT, SEG_POSITIONS, SEG_COLUMNS };

/* run_stack's ``rotary``: a tuple of (cos, sin) address pairs, into ``tables``; returns their count or -1. */
static int read_rotary(PyObject *rotary, rotary_table *tables) {
    if (!PyTuple_Check(rotary) || PyTuple_GET_SIZE(rotary) < 1 || PyTuple_GET_SIZE(rotary) > MAX_ROTARY_TABLES) {
        PyErr_Format(PyExc_ValueError, "rotary is a tuple of 1 to %d (cos, sin) address pairs", MAX_ROTARY_TABLES);
        return -1;
    }
    int count = (int)PyTuple_GET_SIZE(rotary);
    for (int t = 0; t < count; t++) {
        PyObject *pair = PyTuple_GET_ITEM(rotary, t);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_Format(PyExc_ValueError, "rotary table %d is not a (cos, sin) pair of addresses", t);
            return -1;
        }
        if (!(tables[t].cos = address(PyTuple_GET_ITEM(pair, 0), "cos")) || !(tables[t].sin = address(PyTuple_GET_ITEM(pair, 1), "sin")))
            return -1;
    }
    return count;
}

/* Whether the layers that attend in first .. last - 1 read tables the pass has, of its width, and
 * every sequence gives what their windows need (its rows' positions where it is a tree; a window
 * over a mask of every slot is not defined: cached slots' positions are not known). */
static int check_layers_for_pass(const stack_object *S, int first, int last, const uint8_t *flags, int table_count,
                                 int rotary_dims, const int64_t *table, int count) {
    for (int l = first; l < last; l++) {
        const layer_desc *L = S->layers[l];
        if (!(flags[l] & UNIT_ATTENTION)) continue;
        if (L->rotary_table >= table_count || L->rotary_dims != rotary_dims) {
            PyErr_Format(PyExc_ValueError, "layer %d reads rotary table %d of width %d; the pass has %d table(s) of width %d",
                         l, L->rotary_table, L->rotary_dims, table_count, rotary_dims);
            return 0;
        }
        if (L->window > 0)
            for (int i = 0; i < count; i++) {
                const int64_t *row = table + (size_t)SEG_COLUMNS * i;
                if (row[SEG_ATTENDS] && row[SEG_EVERY_SLOT]) {
                    PyErr_Format(PyExc_ValueError, "layer %d has a sliding window, which a mask over every slot does not define", l);
                    return 0;
                }
                if (row[SEG_ATTENDS] && !row[SEG_POSITIONS]) {
                    PyErr_Format(PyExc_ValueError, "layer %d's sliding window needs a tree's positions (sequence %d has none)", l, i);
                    return 0;
                }
            }
    }
    return 1;
}

static PyObject *py_run_stack(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"stack", "first", "last", "hidden", "out", "rows", "rotary", "rotary_dims", "segments", "count",
                            "flags", "threads", "captures", NULL};
    PyObject *capsule, *hin_o, *hout_o, *rotary_o, *seg_o, *captures_o = Py_None;
    int first, last, rows, rotary_dims, count, threads;
    const char *flag_bytes;
    Py_ssize_t flag_count;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiiOOiOiOiy#i|O", names, &capsule, &first, &last, &hin_o, &hout_o, &rows,
                                     &rotary_o, &rotary_dims, &seg_o, &count, &flag_bytes, &flag_count, &threads,
                                     &captures_o))
        return NULL;
    stack_object *S = PyCapsule_GetPointer(capsule, STACK_CAPSULE);
    if (!S) return NULL;
    if (flag_count != S->count) return PyErr_Format(PyExc_ValueError, "flags must be %d bytes, one per layer of the stack", S->count);
    if (first < 0 || last > S->count || first > last) return PyErr_Format(PyExc_ValueError, "layers %d .. %d are outside the stack", first, last);
    if (rows < 1 || count < 1 || count > rows) return PyErr_Format(PyExc_ValueError, "a pass of %d rows in %d sequences", rows, count);
    rotary_table tables[MAX_ROTARY_TABLES];
    int table_count = read_rotary(rotary_o, tables);
    if (table_count < 0) return NULL;
    const float *h_in = address(hin_o, "hidden");
    float *h_out = h_in ? address(hout_o, "out") : NULL;
    const int64_t *table = h_out ? address(seg_o, "segments") : NULL;
    if (!table) return NULL;
    /* captures: the address of int64 [stack count] buffer addresses (0: none), checked by the caller
     * (tierspec.engine.run_stack: each a contiguous float32 [rows, H]) */
    float *const *captures = NULL;
    if (captures_o != Py_None && !(captures = address(captures_o, "captures"))) return NULL;
    const uint8_t *flags = (const uint8_t *)flag_bytes;
    for (int l = 0; l < S->count; l++)
        if (flags[l] & ~(UNIT_ATTENTION | UNIT_MLP)) return PyErr_Format(PyExc_ValueError, "layer %d's flags %d name no unit", l, flags[l]);
    if (!check_layers_for_pass(S, first, last, flags, table_count, rotary_dims, table, count)) return NULL;
    segment_desc *segments = malloc(sizeof(segment_desc) * (size_t)count);
    int *segment_of = malloc(sizeof(int) * (size_t)rows);
    if (!segments || !segment_of) {
        free(segments);
        free(segment_of);
        return PyErr_NoMemory();
    }
    int64_t covered = 0;
    for (int i = 0; i < count; i++) {
        const int64_t *row = table + (size_t)SEG_COLUMNS * i;
        const char *problem = NULL;
        if (row[SEG_FIRST_ROW] != covered || row[SEG_ROWS] < 1 || covered + row[SEG_ROWS] > rows)
            problem = "the sequences must cover the pass's rows in order, one row at least each";
        else if (row[SEG_START] < 0 || row[SEG_KV] == 0)
            problem = "a sequence needs a start of 0 or more and a KV table";
        else if (row[SEG_EVERY_SLOT] && !row[SEG_ATTENDS])
            problem = "a mask over every slot needs its attends";
        if (!problem) {
            const int64_t *kv = (const int64_t *)(intptr_t)row[SEG_KV];
            for (int l = first; l < last && !problem; l++) {
                const int64_t *entry = kv + KV_COLUMNS * (size_t)l;
                if (!(flags[l] & UNIT_ATTENTION)) continue;
                if (entry[0] == 0 || entry[1] == 0 || row[SEG_START] + row[SEG_ROWS] > entry[2]) {
                    PyErr_Format(PyExc_ValueError, "sequence %d's cache of layer %d holds %lld slots, the pass needs %lld", i, l,
                                 (long long)entry[2], (long long)(row[SEG_START] + row[SEG_ROWS]));
                    problem = "";
                } else if (entry[3] != 4 && entry[3] != KV_HALF) {
                    PyErr_Format(PyExc_ValueError, "sequence %d's cache of layer %d has %lld-byte elements: float32 (4) or "
                                 "float16 (2) only", i, l, (long long)entry[3]);
                    problem = "";
                }
            }
        }
        if (problem) {
            if (*problem) PyErr_SetString(PyExc_ValueError, problem);
            free(segments);
            free(segment_of);
            return NULL;
        }
        segments[i] = (segment_desc){(int)row[SEG_FIRST_ROW], (int)row[SEG_ROWS], (int)row[SEG_START],
                                     (const int64_t *)(intptr_t)row[SEG_KV], (const uint8_t *)(intptr_t)row[SEG_ATTENDS],
                                     (int)row[SEG_EVERY_SLOT], (const int64_t *)(intptr_t)row[SEG_POSITIONS]};
        for (int r = segments[i].row0; r < segments[i].row0 + segments[i].n; r++) segment_of[r] = i;
        covered += row[SEG_ROWS];
    }
    if (covered != rows) {
        free(segments);
        free(segment_of);
        return PyErr_Format(PyExc_ValueError, "the sequences cover %lld of the pass's %d rows", (long long)covered, rows);
    }
    pass_desc pass = {.layers = S->layers, .first = first, .last = last, .flags = flags, .h_in = h_in, .h_out = h_out,
                      .rows = rows, .rotary = tables, .rotary_count = table_count, .rotary_dims = rotary_dims,
                      .segments = segments, .count = count, .segment_of = segment_of, .threads = threads,
                      .captures = captures};
    Py_BEGIN_ALLOW_THREADS
    int64_t started = profiling ? now_ns() : 0;
    unsigned csr = flush_denormals();
    run_pass(&pass);
    restore_denormals(csr);
    if (profiling) {
        profile_ns[0] += now_ns() - started;
        profile_ns[3] += last - first;
    }
    Py_END_ALLOW_THREADS
    free(segments);
    free(segment_of);
    Py_RETURN_NONE;
}

/* activate(activation, gate_up, rows, inter, out): the layer's gate function over rows (tests: each
 * path's bits, and the function against a float64 one). */
static PyObject *py_activate(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"activation", "gate_up", "rows", "inter", "out", NULL};
    const char *activation;
    PyObject *in_o, *out_o;
    int rows, inter;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOiiO", names, &activation, &in_o, &rows, &inter, &out_o)) return NULL;
    layer_desc d = {.head_dim = 2};
    if (!read_features(&d, Py_None, Py_None, Py_None, activation)) return NULL;
    if (rows < 1 || inter < 1) return PyErr_Format(PyExc_ValueError, "%d rows of %d gated values", rows, inter);
    const float *in = address(in_o, "gate_up");
    float *out = in ? address(out_o, "out") : NULL;
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
    unsigned csr = flush_denormals();
    activate_rows(d.activation, in, rows, inter, out, 1);
    restore_denormals(csr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* store_half(x, out, count): count float32 values as the float16 bits the engine's caches store
 * (engine.h: half_from_float), by the selected path's kernel (tests). */
static PyObject *py_store_half(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "out", "count", NULL};
    PyObject *in_o, *out_o;
    int count;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOi", names, &in_o, &out_o, &count)) return NULL;
    if (count < 0) return PyErr_Format(PyExc_ValueError, "%d values", count);
    const float *in = address(in_o, "x");
    uint16_t *out = in ? address(out_o, "out") : NULL;
    if (!out) return NULL;
    Py_BEGIN_ALLOW_THREADS
    unsigned csr = flush_denormals();
    kernels.store_half(in, out, count);
    restore_denormals(csr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rms_norm(x, weight, out, rows, width, eps): each of ``rows`` float32 rows of ``width`` values
 * (contiguous) as x / rms(x) * weight into out (which may be x), by the selected path's kernel — the
 * one the layers' norms run. A model's final norm after the stack call: one call where torch's
 * composite rms_norm ran five operators, each cold in the caches after a pass's weights streamed. */
static PyObject *py_rms_norm(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"x", "weight", "out", "rows", "width", "eps", NULL};
    PyObject *in_o, *weight_o, *out_o;
    int rows, width;
    float eps;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOiif", names, &in_o, &weight_o, &out_o, &rows, &width, &eps)) return NULL;
    if (rows < 0 || width < 1) return PyErr_Format(PyExc_ValueError, "%d rows of %d values", rows, width);
    const float *in = address(in_o, "x");
    const float *weight = in ? address(weight_o, "weight") : NULL;
    float *out = weight ? address(out_o, "out") : NULL;
    if (!out) return NULL;
    unsigned csr = flush_denormals();
    for (int r = 0; r < rows; r++) kernels.rms_norm(in + (size_t)r * width, weight, eps, width, out + (size_t)r * width);
    restore_denormals(csr);
    Py_RETURN_NONE;
}

/* ---- the CPU, kernel paths and profiles ------------------------------------------------------- */

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(isa_names[cpu.level]);
}

static PyObject *py_isas(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    int top = cpu.best < cpu.cap ? cpu.best : cpu.cap;
    PyObject *out = PyTuple_New(top + 1);
    for (int i = 0; out && i <= top; i++) PyTuple_SET_ITEM(out, i, PyUnicode_FromString(isa_names[i]));
    return out;
}

static PyObject *py_select_isa(PyObject *self, PyObject *name) {
    (void)self;
    const char *text = PyUnicode_AsUTF8(name);
    if (!text) return NULL;
    int level = isa_by_name(text), top = cpu.best < cpu.cap ? cpu.best : cpu.cap;
    if (level < 0 || level > top)
        return PyErr_Format(PyExc_ValueError, "kernel path %R is not one this process runs (it runs portable .. %s)", name,
                            isa_names[top]);
    select_kernels(level);
    Py_RETURN_NONE;
}

static PyObject *py_emulate_amx(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    if (!install_emulated_amx(&kernels)) return PyErr_Format(PyExc_ValueError, "the emulated AMX kernels need the avx512 path");
    Py_RETURN_NONE;
}

static int set_item(PyObject *dict, const char *key, PyObject *value) {
    if (!value) return -1;
    int failed = PyDict_SetItemString(dict, key, value);
    Py_DECREF(value);
    return failed;
}

/* probe() -> the CPU's features, the OS's state, the AMX probe's result and the path each kernel
 * takes now. */
static PyObject *py_probe(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *out = PyDict_New(), *features = PyDict_New(), *paths = PyDict_New();
    if (!out || !features || !paths) goto fail;
    const struct { const char *name; int value; } listed[] = {
        {"avx2", cpu.avx2}, {"fma", cpu.fma}, {"f16c", cpu.f16c}, {"avx512f", cpu.avx512f}, {"avx512bw", cpu.avx512bw},
        {"avx512vl", cpu.avx512vl}, {"avx512dq", cpu.avx512dq}, {"avx512cd", cpu.avx512cd}, {"avx512vnni", cpu.avx512vnni},
        {"avx512bf16", cpu.avx512bf16}, {"amx_tile", cpu.amx_tile}, {"amx_bf16", cpu.amx_bf16}, {"amx_int8", cpu.amx_int8},
        {"os_ymm", cpu.os_ymm}, {"os_zmm", cpu.os_zmm}, {"os_tiles", cpu.os_tiles}};
    for (size_t i = 0; i < sizeof listed / sizeof listed[0]; i++)
        if (set_item(features, listed[i].name, PyBool_FromLong(listed[i].value))) goto fail;
    static const char *layout_names[LAYOUTS] = {"bfloat16", "float32", "int8"};
    for (int layout = 0; layout < LAYOUTS; layout++)
        if (set_item(paths, layout_names[layout], PyUnicode_FromString(isa_names[kernels.tile[layout][KIND_Q4].isa]))) goto fail;
    static const char *op_names[OPS] = {"rows_float32", "rows_bfloat16", "rows_int8", "exp", "rms_norm", "attention", "store_half",
                                              "first_max", "attention_rows", "keyed_max"};
    for (int op = 0; op < OPS; op++)
        if (set_item(paths, op_names[op], PyUnicode_FromString(isa_names[kernels.isa[op]]))) goto fail;
    if (set_item(out, "isa", PyUnicode_FromString(isa_names[cpu.level])) ||
        set_item(out, "best", PyUnicode_FromString(isa_names[cpu.best])) ||
        set_item(out, "cap", cpu.cap_set ? PyUnicode_FromString(isa_names[cpu.cap]) : Py_NewRef(Py_None)) ||
        set_item(out, "amx", PyBool_FromLong(cpu.amx)) ||
        set_item(out, "amx_reason", PyUnicode_FromString(cpu.amx_reason)) ||
        set_item(out, "pass_rows", PyLong_FromLong(kernels.pass_rows)) ||
        PyDict_SetItemString(out, "features", features) || PyDict_SetItemString(out, "paths", paths))
        goto fail;
    Py_DECREF(features);
    Py_DECREF(paths);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(features);
    Py_XDECREF(paths);
    return NULL;
}

static PyObject *py_block_types(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < block_type_count; i++) {
        PyObject *key = PyLong_FromLong(block_types[i].ggml_type);
        PyObject *value = Py_BuildValue("(sii)", block_types[i].name, block_types[i].inputs, block_types[i].block_bytes);
        if (!key || !value || PyDict_SetItem(out, key, value)) {
            Py_XDECREF(key);
            Py_XDECREF(value);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(value);
    }
    return out;
}

/* profile(on) -> (stack seconds, matrix seconds, attention seconds, layer runs, rows handed to attend_rows
 * in blocks, attention tasks) since the last call */
static PyObject *py_profile(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *out = Py_BuildValue("(dddLLL)", profile_ns[0] * 1e-9, profile_ns[1] * 1e-9, profile_ns[2] * 1e-9,
                                  (long long)profile_ns[3], (long long)profile_ns[4], (long long)profile_ns[5]);
    memset(profile_ns, 0, sizeof profile_ns);
    profiling = PyObject_IsTrue(arg);
    return out;
}

#define KW(name, doc) {#name, (PyCFunction)(void (*)(void))py_##name, METH_VARARGS | METH_KEYWORDS, doc}
static PyMethodDef methods[] = {
    KW(new_weight, "new_weight(ggml_type, layout, round_rows, out_features, in_features): an empty repacked weight."),
    {"weight_bytes", py_weight_bytes, METH_O, "Bytes of a repacked weight (what a product streams)."},
    KW(one_thread_rows, "one_thread_rows(weight[, rows]): products over that many rows or fewer on one thread (None: the default); the setting."),
    {"stack_weights", py_stack_weights, METH_O, "stack_weights(parts): one weight of the parts' rows in order (any types)."},
    KW(repack, "repack(weight, blocks, rows, order, row0): GGUF rows (addresses) into rows row0.. of a weight."),
    KW(dequant_rows, "dequant_rows(weight, indices, count, out): rows of a weight as float32."),
    KW(gather_rows, "gather_rows(weight, indices, count): those rows as a new weight."),
    KW(matmul, "matmul(weight, x, rows, out, out_stride, accumulate, threads, maxima=False, keys=None, temperatures=None): "
                "out (+)= x W^T; with maxima, returns each row's first maximum of its outputs (a list; -1 for a row "
                "holding a NaN); with keys (an int or None per row) and temperatures (a float per row), returns "
                "(maxima, draws): each keyed row's perturbed argmax of its outputs / temperature under its key's "
                "Gumbel noise (-1: a NaN; -2: not keyed, or a row of +inf or only -inf, drawn elsewhere)."),
    KW(make_layer, "make_layer(qkv, o, gate_up, down, norm_in, norm_post, eps, hidden, heads, kv_heads, head_dim, inter, *, "
                   "qkv_bias, q_norm, k_norm, attention_out_norm, mlp_out_norm, activation, window, rotary_table, rotary_dims, "
                   "attention_scale, softcap): a decoder layer (the keyword-only features default to Llama's layer)."),
    KW(activate, "activate(activation, gate_up, rows, inter, out): out = act(g) * u over rows of gate_up = [g, u] (tests)."),
    KW(store_half, "store_half(x, out, count): float32 values as the float16 bits the caches store (tests)."),
    KW(rms_norm, "rms_norm(x, weight, out, rows, width, eps): rows of x / rms(x) * weight by the layers' norm kernel."),
    {"make_stack", py_make_stack, METH_O, "make_stack(layers): a decoder's layers for run_stack."},
    KW(run_stack, "run_stack(stack, first, last, hidden, out, rows, rotary, rotary_dims, segments, count, flags, threads[, captures])."),
    {"isa", py_isa, METH_NOARGS, "The kernel path in use: portable, avx2, avx512, avx512vnni, avx512bf16 or amx."},
    {"isas", py_isas, METH_NOARGS, "The kernel paths this process may select (portable .. the best allowed)."},
    {"select_isa", py_select_isa, METH_O, "Use the kernels of a lower path (tests; between passes only)."},
    {"emulate_amx", py_emulate_amx, METH_NOARGS,
     "Tests: the AMX kernels over emulated tile instructions, until the next select_isa."},
    {"probe", py_probe, METH_NOARGS, "The CPU's features, the AMX probe's result and each kernel's path."},
    {"block_types", py_block_types, METH_NOARGS, "The natively computed ggml types: {id: (name, values, bytes)}."},
    {"profile", py_profile, METH_O, "Time spent in stack calls, their products and attention, layer runs, rows attended in blocks and attention tasks (and switch it on/off)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qengine", "tierspec's pass engine (tierspec/csrc).", -1, methods};

PyMODINIT_FUNC PyInit__qengine(void) {
    char error[300];
    if (cpu_init(error, sizeof error) != 0) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    return PyModule_Create(&module);
}
