/* The natively computed GGUF block types, and weights repacked from them into the engine's cells
 * (blocks.h), read back as float32 rows, or gathered into a weight of fewer rows. */
#include <math.h>

#include "blocks.h"

/* float -> fp16, round to nearest even (used for Q4_0's m = -8d, which is exact) */
static uint16_t float_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int exp = (int)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = x & 0x7fffff;
    if (((x >> 23) & 0xff) == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 : 0));
    if (exp >= 31) return (uint16_t)(sign | 0x7c00);
    if (exp <= 0) {
        if (exp < -10) return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - exp;
        uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rem > mid || (rem == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = (uint32_t)(exp << 10) | (mant >> 13), rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) half++;
    return (uint16_t)(sign | half);
}

static void nibbles(const uint8_t qs[16], int q[QK]) {
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0f;
        q[i + 16] = qs[i] >> 4;
    }
}

static void read_q4_0(const uint8_t *src, uint16_t *d, uint16_t *m, int q[QK]) {
    gguf_q4_0 b;
    memcpy(&b, src, sizeof b);
    *d = b.d;
    *m = float_to_fp16(-8.0f * fp16_to_float(b.d)); /* w = d*(q - 8) = d*q + (-8d) */
    nibbles(b.qs, q);
}

static void read_q4_1(const uint8_t *src, uint16_t *d, uint16_t *m, int q[QK]) {
    gguf_q4_1 b;
    memcpy(&b, src, sizeof b);
    *d = b.d;
    *m = b.m;
    nibbles(b.qs, q);
}

static void read_q8_0(const uint8_t *src, uint16_t *d, uint16_t *m, int q[QK]) {
    gguf_q8_0 b;
    memcpy(&b, src, sizeof b);
    *d = b.d;
    *m = 0;
    for (int i = 0; i < QK; i++) q[i] = b.qs[i];
}

const block_type block_types[] = {
    {GGML_Q4_0, "Q4_0", sizeof(gguf_q4_0), KIND_Q4, read_q4_0},
    {GGML_Q4_1, "Q4_1", sizeof(gguf_q4_1), KIND_Q4, read_q4_1},
    {GGML_Q8_0, "Q8_0", sizeof(gguf_q8_0), KIND_Q8, read_q8_0},
};
const int block_type_count = (int)(sizeof block_types / sizeof block_types[0]);

const block_type *find_block_type(int ggml_type) {
    for (int i = 0; i < block_type_count; i++)
        if (block_types[i].ggml_type == ggml_type) return &block_types[i];
    return NULL;
}

size_t packed_bytes(int kind, int N, int K) { return (size_t)((N + TILE - 1) / TILE) * (size_t)(K / QK) * cell_bytes(kind); }

/* One value q of row r, input k of a cell. */
static inline int cell_value(int kind, int layout, const uint8_t *cell, int r, int k) {
    if (kind == KIND_Q4) {
        int byte, shift;
        q4_slot(layout, r, k, &byte, &shift);
        return (((const cell_q4 *)cell)->q[byte] >> shift) & 0x0f;
    }
    return q8_load(layout, ((const cell_q8 *)cell)->q[q8_slot(layout, r, k)]);
}

static inline void set_cell_value(int kind, int layout, uint8_t *cell, int r, int k, int q) {
    if (kind == KIND_Q4) {
        int byte, shift;
        q4_slot(layout, r, k, &byte, &shift);
        ((cell_q4 *)cell)->q[byte] |= (uint8_t)(q << shift); /* the cell was cleared */
    } else {
        ((cell_q8 *)cell)->q[q8_slot(layout, r, k)] = q8_store(layout, q);
    }
}

/* scales of row r: the d (and m, Q4) words */
static inline void cell_scales(int kind, const uint8_t *cell, int r, uint16_t *d, uint16_t *m) {
    if (kind == KIND_Q4) {
        *d = ((const cell_q4 *)cell)->d[r];
        *m = ((const cell_q4 *)cell)->m[r];
    } else {
        *d = ((const cell_q8 *)cell)->d[r];
        *m = 0;
    }
}

static inline void set_cell_scales(int kind, uint8_t *cell, int r, uint16_t d, uint16_t m) {
    if (kind == KIND_Q4) {
        ((cell_q4 *)cell)->d[r] = d;
        ((cell_q4 *)cell)->m[r] = m;
    } else {
        ((cell_q8 *)cell)->d[r] = d;
    }
}

/* GGUF rows (each K/32 blocks of ``type``) as rows row0 .. row0 + count - 1 of ``w`` (a weight
 * stacked from parts, e.g. q/k/v, is repacked part by part, in order; each tile is cleared when its
 * first row is written, so rows past the last one are zero); row row0 + n is source row order[n]
 * (NULL: n). */
void repack(packed_weight *w, const block_type *type, const uint8_t *src, const int64_t *order, int count, int row0) {
    int KB = w->K / QK;
    size_t cb = cell_bytes(w->kind), bb = (size_t)type->block_bytes;
    for (int n = 0; n < count; n++) {
        int t = (row0 + n) / TILE, r = (row0 + n) % TILE;
        const uint8_t *from = src + (size_t)(order ? order[n] : n) * KB * bb;
        if (r == 0) memset(w->cells + (size_t)t * KB * cb, 0, (size_t)KB * cb);
        for (int b = 0; b < KB; b++) {
            uint16_t d, m;
            int q[QK];
            type->read(from + (size_t)b * bb, &d, &m, q);
            uint8_t *cell = (uint8_t *)cell_at(w, t, b);
            set_cell_scales(w->kind, cell, r, d, m);
            for (int k = 0; k < QK; k++) set_cell_value(w->kind, w->layout, cell, r, k, q[k]);
        }
    }
}

/* Rows ``rows`` of a repacked weight as float32 [count, K]: d*q + m exactly (one rounding). */
void dequant_rows(const packed_weight *w, const int64_t *rows, int count, float *out) {
    int KB = w->K / QK;
    for (int c = 0; c < count; c++) {
        int t = (int)(rows[c] / TILE), r = (int)(rows[c] % TILE);
        for (int b = 0; b < KB; b++) {
            const uint8_t *cell = cell_at(w, t, b);
            uint16_t dh, mh;
            cell_scales(w->kind, cell, r, &dh, &mh);
            float d = fp16_to_float(dh), m = fp16_to_float(mh);
            for (int k = 0; k < QK; k++)
                out[(size_t)c * w->K + b * QK + k] = fmaf(d, (float)cell_value(w->kind, w->layout, cell, r, k), m);
        }
    }
}

/* Rows ``rows`` of ``w`` as the weight ``dst`` of ``count`` rows (the same values, its cells
 * allocated by the caller): a draft head's vocabulary, a subset of the target's LM head. */
void gather_rows(const packed_weight *w, const int64_t *rows, int count, packed_weight *dst) {
    int KB = w->K / QK;
    memset(dst->cells, 0, dst->bytes);
    for (int c = 0; c < count; c++) {
        int st = (int)(rows[c] / TILE), sr = (int)(rows[c] % TILE), dt = c / TILE, dr = c % TILE;
        for (int b = 0; b < KB; b++) {
            const uint8_t *from = cell_at(w, st, b);
            uint8_t *to = (uint8_t *)cell_at(dst, dt, b);
            uint16_t d, m;
            cell_scales(w->kind, from, sr, &d, &m);
            set_cell_scales(w->kind, to, dr, d, m);
            for (int k = 0; k < QK; k++) set_cell_value(w->kind, w->layout, to, dr, k, cell_value(w->kind, w->layout, from, sr, k));
        }
    }
}
