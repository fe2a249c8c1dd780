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

static void read_q4_0(const uint8_t *src, block_values *v) {
    gguf_q4_0 b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = float_to_fp16(-8.0f * fp16_to_float(b.d)); /* w = d*(q - 8) = d*q + (-8d) */
    nibbles(b.qs, v->q);
}

static void read_q4_1(const uint8_t *src, block_values *v) {
    gguf_q4_1 b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = b.m;
    nibbles(b.qs, v->q);
}

static void read_q8_0(const uint8_t *src, block_values *v) {
    gguf_q8_0 b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = 0;
    for (int i = 0; i < QK; i++) v->q[i] = b.qs[i];
}

/* Sub-block j's 6-bit scale and minimum from a Q4_K/Q5_K block's 12 bytes: for j < 4 the low six
 * bits of bytes j and j + 4; for j >= 4 a nibble of byte j + 4 with the top two bits of bytes j - 4
 * (scale) and j (minimum) above it. */
static void k_scale_min(const uint8_t s[12], int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void read_q4_k(const uint8_t *src, block_values *v) {
    gguf_q4_k b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = b.dmin;
    for (int j = 0; j < QK_K / QK; j++) {
        k_scale_min(b.scales, j, &v->sc[j], &v->mn[j]);
        for (int i = 0; i < QK; i++) v->q[QK * j + i] = (b.qs[QK * (j / 2) + i] >> (4 * (j & 1))) & 0x0f;
    }
}

static void read_q5_k(const uint8_t *src, block_values *v) {
    gguf_q5_k b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = b.dmin;
    for (int j = 0; j < QK_K / QK; j++) {
        k_scale_min(b.scales, j, &v->sc[j], &v->mn[j]);
        for (int i = 0; i < QK; i++)
            v->q[QK * j + i] = ((b.qs[QK * (j / 2) + i] >> (4 * (j & 1))) & 0x0f) | (((b.qh[i] >> j) & 1) << 4);
    }
}

static void read_q6_k(const uint8_t *src, block_values *v) {
    gguf_q6_k b;
    memcpy(&b, src, sizeof b);
    v->d = b.d;
    v->m = 0;
    for (int n = 0; n < QK_K / 16; n++) v->sc[n] = b.scales[n];
    for (int n = 0; n < QK_K; n++) {
        int h = n / 128, c = (n % 128) / 32, i = n % 32;
        int low = (b.ql[64 * h + 32 * (c & 1) + i] >> (4 * (c >> 1))) & 0x0f;
        v->q[n] = low | (((b.qh[32 * h + i] >> (2 * c)) & 3) << 4);
    }
}

const block_type block_types[] = {
    {GGML_Q4_0, "Q4_0", QK, sizeof(gguf_q4_0), KIND_Q4, read_q4_0},
    {GGML_Q4_1, "Q4_1", QK, sizeof(gguf_q4_1), KIND_Q4, read_q4_1},
    {GGML_Q8_0, "Q8_0", QK, sizeof(gguf_q8_0), KIND_Q8, read_q8_0},
    {GGML_Q4_K, "Q4_K", QK_K, sizeof(gguf_q4_k), KIND_Q4K, read_q4_k},
    {GGML_Q5_K, "Q5_K", QK_K, sizeof(gguf_q5_k), KIND_Q5K, read_q5_k},
    {GGML_Q6_K, "Q6_K", QK_K, sizeof(gguf_q6_k), KIND_Q6K, read_q6_k},
};
const int block_type_count = (int)(sizeof block_types / sizeof block_types[0]);

const block_type *find_block_type(int ggml_type) {
    for (int i = 0; i < block_type_count; i++)
        if (block_types[i].ggml_type == ggml_type) return &block_types[i];
    return NULL;
}

size_t packed_bytes(int kind, int N, int K) {
    return (size_t)((N + TILE - 1) / TILE) * (size_t)(K / (QK * cell_blocks(kind))) * cell_bytes(kind);
}

/* Sets the stored integer of row r, input k of sub-block j (the cell was cleared). */
static void set_value(int kind, int layout, uint8_t *cell, int r, int j, int k, int v) {
    int byte, shift, bit, bits = high_bits(kind);
    uint8_t *q, *hi = NULL;
    switch (kind) {
    case KIND_Q4: q = ((cell_q4 *)cell)->q; break;
    case KIND_Q8: ((cell_q8 *)cell)->q[q8_slot(layout, r, k)] = q8_store(layout, v); return;
    case KIND_Q4K: q = ((cell_q4k *)cell)->q[j]; break;
    case KIND_Q5K: q = ((cell_q5k *)cell)->q[j], hi = ((cell_q5k *)cell)->hi[j]; break;
    case KIND_Q6K: q = ((cell_q6k *)cell)->q[j], hi = ((cell_q6k *)cell)->hi[j]; break;
    default: UNKNOWN_KIND();
    }
    q4_slot(layout, r, k, &byte, &shift);
    q[byte] |= (uint8_t)((v & 0x0f) << shift);
    for (int b = 0; b < bits; b++) {
        hi_slot(layout, bits, r, k, b, &byte, &bit);
        hi[byte] |= (uint8_t)(((v >> (4 + b)) & 1) << bit);
    }
}

/* Row r of a (cleared) cell from one file block's values. */
static void set_cell_row(int kind, int layout, uint8_t *cell, int r, const block_values *v) {
    switch (kind) {
    case KIND_Q4:
        ((cell_q4 *)cell)->d[r] = v->d;
        ((cell_q4 *)cell)->m[r] = v->m;
        break;
    case KIND_Q8: ((cell_q8 *)cell)->d[r] = v->d; break;
    case KIND_Q4K: case KIND_Q5K: { /* the two cells share these fields' places */
        cell_q4k *c = (cell_q4k *)cell;
        c->d[r] = v->d;
        c->dmin[r] = v->m;
        for (int j = 0; j < QK_K / QK; j++) c->sc[j][r] = (uint8_t)v->sc[j], c->mn[j][r] = (uint8_t)v->mn[j];
        break;
    }
    case KIND_Q6K: {
        cell_q6k *c = (cell_q6k *)cell;
        c->d[r] = v->d;
        for (int n = 0; n < QK_K / 16; n++) c->sc[n][r] = (int8_t)v->sc[n];
        break;
    }
    default: UNKNOWN_KIND();
    }
    for (int j = 0; j < cell_blocks(kind); j++)
        for (int k = 0; k < QK; k++) set_value(kind, layout, cell, r, j, k, v->q[QK * j + k]);
}

/* Row r of a cell read back as the file block's values (set_cell_row's inverse). */
static void get_cell_row(int kind, int layout, const uint8_t *cell, int r, block_values *v) {
    memset(v, 0, sizeof *v);
    switch (kind) {
    case KIND_Q4:
        v->d = ((const cell_q4 *)cell)->d[r];
        v->m = ((const cell_q4 *)cell)->m[r];
        break;
    case KIND_Q8: v->d = ((const cell_q8 *)cell)->d[r]; break;
    case KIND_Q4K: case KIND_Q5K: {
        const cell_q4k *c = (const cell_q4k *)cell;
        v->d = c->d[r];
        v->m = c->dmin[r];
        for (int j = 0; j < QK_K / QK; j++) v->sc[j] = c->sc[j][r], v->mn[j] = c->mn[j][r];
        break;
    }
    case KIND_Q6K: {
        const cell_q6k *c = (const cell_q6k *)cell;
        v->d = c->d[r];
        for (int n = 0; n < QK_K / 16; n++) v->sc[n] = c->sc[n][r];
        break;
    }
    default: UNKNOWN_KIND();
    }
    for (int j = 0; j < cell_blocks(kind); j++)
        for (int k = 0; k < QK; k++) v->q[QK * j + k] = stored_value(kind, layout, cell, r, j, k);
}

/* GGUF rows (each K / type->inputs blocks of ``type``) as rows row0 .. row0 + count - 1 of ``w`` (a
 * weight stacked from parts of one type, e.g. q/k/v, is repacked part by part, in order; each tile is
 * cleared when its first row is written, so rows past the last one are zero); row row0 + n is source
 * row order[n] (NULL: n). */
void repack(packed_weight *w, const block_type *type, const uint8_t *src, const int64_t *order, int count, int row0) {
    int cells = w->K / type->inputs;
    size_t cb = cell_bytes(w->kind), bb = (size_t)type->block_bytes;
    block_values v;
    for (int n = 0; n < count; n++) {
        int t = (row0 + n) / TILE, r = (row0 + n) % TILE;
        const uint8_t *from = src + (size_t)(order ? order[n] : n) * cells * bb;
        if (r == 0) memset(w->cells + (size_t)t * cells * cb, 0, (size_t)cells * cb);
        for (int c = 0; c < cells; c++) {
            type->read(from + (size_t)c * bb, &v);
            set_cell_row(w->kind, w->layout, (uint8_t *)cell_at(w, t, c), r, &v);
        }
    }
}

/* Rows ``rows`` of a repacked weight as float32 [count, K], each value one rounding of the file's
 * exact expression (blocks.h): d*q + m, d*q, D*q - M, D*(u - 32). */
void dequant_rows(const packed_weight *w, const int64_t *rows, int count, float *out) {
    if (w->parts) { /* a stacked weight: each row from its part */
        for (int c = 0; c < count; c++) {
            int i = w->parts - 1;
            while (rows[c] < w->part_row0[i]) i--;
            int64_t local = rows[c] - w->part_row0[i];
            dequant_rows(w->part[i], &local, 1, out + (size_t)c * w->K);
        }
        return;
    }
    int KB = w->K / QK, minimum = has_minimum(w->kind);
    for (int c = 0; c < count; c++) {
        int t = (int)(rows[c] / TILE), r = (int)(rows[c] % TILE);
        for (int b = 0; b < KB; b++) {
            int j;
            const uint8_t *cell = block_cell(w, t, b, &j);
            float d[2], mn;
            block_scales(w->kind, cell, r, j, d, &mn);
            for (int k = 0; k < QK; k++) {
                float v = (float)product_value(w->kind, w->layout, cell, r, j, k);
                out[(size_t)c * w->K + b * QK + k] = minimum ? fmaf(d[k / 16], v, mn) : d[k / 16] * v;
            }
        }
    }
}

/* Rows ``rows`` of ``w`` as the weight ``dst`` of ``count`` rows (the same values, its cells
 * allocated by the caller): a draft head's vocabulary, a subset of the target's LM head. */
void gather_rows(const packed_weight *w, const int64_t *rows, int count, packed_weight *dst) {
    int cells = w->K / (QK * cell_blocks(w->kind));
    memset(dst->cells, 0, dst->bytes);
    block_values v;
    for (int c = 0; c < count; c++) {
        int st = (int)(rows[c] / TILE), sr = (int)(rows[c] % TILE), dt = c / TILE, dr = c % TILE;
        for (int b = 0; b < cells; b++) {
            get_cell_row(w->kind, w->layout, cell_at(w, st, b), sr, &v);
            set_cell_row(w->kind, w->layout, (uint8_t *)cell_at(dst, dt, b), dr, &v);
        }
    }
}
