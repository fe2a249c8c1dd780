/* Block formats: the GGUF file's blocks as ggml defines them, and the engine's cells (a tile of 16
 * output rows by one block of 32 inputs, repacked for the kernels), each a typed struct whose size is
 * checked at compile time; and the number conversions the formats need.
 *
 * A weight's values are exactly the file's: Q4_0 / Q4_1 are d*q + m (q in 0..15; Q4_0's m = -8d,
 * exact in fp16), Q8_0 is d*q (q in -128..127), d and m the block's fp16 values.
 *
 * How a new block type joins (issue 38's K-quants, F16/BF16 rows): a GGUF struct here, an entry in
 * ``block_types`` (blocks.c) that reads one block into (scale, minimum, integer values) per 32
 * inputs, and, where its values do not fit an existing cell kind, a new ``cell_kind`` with its struct
 * and a case in each kernel's scale loading. The tiles, threads, layers and binding stay as they are.
 */
#ifndef TIERSPEC_BLOCKS_H
#define TIERSPEC_BLOCKS_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TILE 16 /* output rows per tile (the lanes of a 512-bit float32 vector) */
#define QK 32   /* weights per block */

/* ---- the file's blocks (ggml's layouts) -------------------------------------------------------- */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 }; /* ggml type ids */

typedef struct {
    uint16_t d;      /* fp16 scale */
    uint8_t qs[16];  /* value i in the low nibble of byte i, value 16 + i in its high nibble */
} gguf_q4_0;
typedef struct {
    uint16_t d, m;   /* fp16 scale and minimum */
    uint8_t qs[16];
} gguf_q4_1;
typedef struct {
    uint16_t d;
    int8_t qs[32];
} gguf_q8_0;
static_assert(sizeof(gguf_q4_0) == 18, "a Q4_0 block is 18 bytes");
static_assert(sizeof(gguf_q4_1) == 20, "a Q4_1 block is 20 bytes");
static_assert(sizeof(gguf_q8_0) == 34, "a Q8_0 block is 34 bytes");

/* ---- the engine's cells ------------------------------------------------------------------------ */

/* Cell kinds: what a cell stores per output row (its scale, its minimum, its values' width). */
enum { KIND_Q4 = 0, KIND_Q8 = 1, KINDS };

/* Q4_0 and Q4_1: 16 rows' fp16 d and m, then 16 x 32 nibbles placed by the layout (q4_slot). */
typedef struct {
    uint16_t d[TILE];
    uint16_t m[TILE];
    uint8_t q[TILE * QK / 2];
} cell_q4;
/* Q8_0: 16 rows' fp16 d, then 16 x 32 bytes placed by the layout (q8_slot). */
typedef struct {
    uint16_t d[TILE];
    uint8_t q[TILE * QK];
} cell_q8;
static_assert(sizeof(cell_q4) == 320, "a Q4 cell is 320 bytes");
static_assert(sizeof(cell_q8) == 544, "a Q8 cell is 544 bytes");
static_assert(offsetof(cell_q4, q) == 64 && offsetof(cell_q8, q) == 32, "cells hold their scales first");

static inline size_t cell_bytes(int kind) { return kind == KIND_Q4 ? sizeof(cell_q4) : sizeof(cell_q8); }

/* Layouts: how a cell's values are ordered for the products that read them (quant.Numerics.layout).
 *  LAYOUT_BF16: bfloat16 dot products (vdpbf16ps, AMX tdpbf16ps) take pairs of k per output row;
 *  LAYOUT_F32:  float32 FMAs take one k at a time for every output row (16 lanes);
 *  LAYOUT_INT8: int8 dot products (vpdpbusd, AMX tdpbsud) take quads of k per output row. */
enum { LAYOUT_BF16 = 0, LAYOUT_F32 = 1, LAYOUT_INT8 = 2, LAYOUTS };

/* Where q(row r of the tile, k of the block) lives in a Q4 cell's q area: (byte, shift). */
static inline void q4_slot(int layout, int r, int k, int *byte, int *shift) {
    if (layout == LAYOUT_INT8) { /* quad g = k/4: 64 values at 4r + k%4; byte p holds values p (low) and 32 + p (high) */
        int pos = 4 * r + (k & 3);
        *byte = 32 * (k >> 2) + (pos & 31);
        *shift = pos >= 32 ? 4 : 0;
    } else if (layout == LAYOUT_BF16) { /* pair p = k/2, word j = 2r + (k&1); 32-byte groups hold pairs (2g, 2g+1) */
        int p = k >> 1, j = 2 * r + (k & 1);
        *byte = 32 * (p >> 1) + j;
        *shift = (p & 1) ? 4 : 0;
    } else { /* pairs of k: 16 bytes, byte r = row r's k (low) and k + 1 (high) */
        *byte = 16 * (k >> 1) + r;
        *shift = (k & 1) ? 4 : 0;
    }
}

/* Where q(r, k) lives in a Q8 cell's q area. */
static inline int q8_slot(int layout, int r, int k) {
    if (layout == LAYOUT_INT8) return 64 * (k >> 2) + 4 * r + (k & 3); /* quads of k per row */
    if (layout == LAYOUT_BF16) return 32 * (k >> 1) + 2 * r + (k & 1); /* pairs of k per row */
    return 16 * k + r;                                                  /* per k: rows 0..15 */
}

/* A Q8 value as stored: LAYOUT_INT8 keeps q + 128 (unsigned: the operand the int8 products take
 * unsigned); the others keep q. */
static inline uint8_t q8_store(int layout, int q) { return layout == LAYOUT_INT8 ? (uint8_t)(q + 128) : (uint8_t)(int8_t)q; }
static inline int q8_load(int layout, uint8_t v) { return layout == LAYOUT_INT8 ? (int)v - 128 : (int)(int8_t)v; }

/* ---- numbers ----------------------------------------------------------------------------------- */

static inline float fp16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do { e++; mant <<= 1; } while (!(mant & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even; NaN kept quiet */
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* ---- block types ------------------------------------------------------------------------------- */

/* A natively computed GGUF type: its id, name, bytes per block of 32, the cell kind it repacks into,
 * and how one of its blocks reads as (d, m as fp16 bits, q[32]) with w = d*q + m. */
typedef struct {
    int ggml_type;
    const char *name;
    int block_bytes;
    int kind;
    void (*read)(const uint8_t *block, uint16_t *d, uint16_t *m, int q[QK]);
} block_type;

extern const block_type block_types[];
extern const int block_type_count;
const block_type *find_block_type(int ggml_type); /* NULL: not native */

/* A weight [N, K] repacked: ceil(N/16) tiles of K/32 cells, tile-major; rows past N are zero. */
typedef struct {
    int ggml_type, kind, layout;
    int round_rows; /* LAYOUT_F32 only: rows rounded to bfloat16 values first (bfloat16 emulated) */
    int N, K;
    uint8_t *cells; /* 64-byte aligned, owned */
    size_t bytes;
} packed_weight;

static inline const uint8_t *cell_at(const packed_weight *w, int tile, int block) {
    return w->cells + ((size_t)tile * (w->K / QK) + block) * cell_bytes(w->kind);
}

size_t packed_bytes(int kind, int N, int K);
void repack(packed_weight *w, const block_type *type, const uint8_t *src, const int64_t *order, int count, int row0);
void dequant_rows(const packed_weight *w, const int64_t *rows, int count, float *out);
void gather_rows(const packed_weight *w, const int64_t *rows, int count, packed_weight *dst);

#endif
