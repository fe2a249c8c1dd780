/* Block formats: the GGUF file's blocks as ggml defines them, and the engine's cells (a tile of 16
 * output rows by one file block of inputs, repacked for the kernels), each a typed struct whose size
 * is checked at compile time; and the number conversions the formats need.
 *
 * A weight's values are exactly the file's, per block of 32 inputs (a "sub-block" inside a K-quant's
 * super-block of 256):
 *   Q4_0 / Q4_1  d*q + m, q in 0..15 (Q4_0's m = -8d, exact in fp16), d and m the block's fp16 values;
 *   Q8_0         d*q, q in -128..127;
 *   Q4_K / Q5_K  D*q - M, q in 0..15 / 0..31, D = d*sc and M = dmin*mn with d, dmin the super-block's
 *                fp16 values and sc, mn its 6-bit integers for this sub-block;
 *   Q6_K         D*(u - 32), u in 0..63, D = d*sc with sc the super-block's signed 8-bit scale of each
 *                16 inputs (two per sub-block).
 * D and M are exact in float32 (an 11-bit significand times a 6- or 8-bit integer), and so is D*q (at
 * most 23 bits), so every value is one rounding of an exact expression: gguf-py's ``dequantize``
 * computes the same float32 operations and gets the same bits.
 *
 * Why the K-quant cells keep the file's integers (the numbers: bytes streamed per weight, a pass over
 * a few rows being bound by them). A cell covers one super-block (16 rows x 256 inputs) and stores,
 * per row, the fp16 d (and dmin) once and the 8-bit sub-scales (and minimums), the 4-bit parts of the
 * values in the Q4 cell's layouts and the fifth/sixth bits in planes beside them:
 *   Q4_K 2368 bytes per 4096 weights = 4.625 bits (the file: 4.5,    1.03x)
 *   Q5_K 2880                         = 5.625     (the file: 5.5,    1.02x)
 *   Q6_K 3360                         = 6.5625    (the file: 6.5625, 1.00x)
 * The kernels form D = d*sc and M = dmin*mn per sub-block and 16 rows (a convert and a multiply per
 * 512 weights, nothing beside the values' own decoding). The alternatives measured on paper: cells
 * of 32 inputs with each sub-block's D and M as float32 (exact, the existing kernels' shape) stream
 * (16*8 + 256)/512 = 6 bits per Q4_K weight, 1.33x the file; cells of 32 inputs repeating d and dmin
 * beside the 8-bit integers stream 5.5 bits, 1.22x; Q6_K as 8-bit values (the Q8 kernels) 9 bits,
 * 1.37x. At 1.0-1.03x the one-row pass streams what llama.cpp streams.
 *
 * How a new block type joins: a GGUF struct here, an entry in ``block_types`` (blocks.c) that reads
 * one file block into ``block_values``, and, where its values do not fit an existing cell kind, a new
 * ``cell_kind`` with its struct, its cases in the cell accessors below and in every kernel (each
 * switches on the kind and traps on one it does not know). The tiles, threads, layers and binding
 * stay as they are.
 */
#ifndef TIERSPEC_BLOCKS_H
#define TIERSPEC_BLOCKS_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TILE 16  /* output rows per tile (the lanes of a 512-bit float32 vector) */
#define QK 32    /* inputs per block (a K-quant's sub-block) */
#define QK_K 256 /* inputs per K-quant super-block */

/* ---- the file's blocks (ggml's layouts) -------------------------------------------------------- */

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 }; /* ggml type ids */

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
/* Q4_K: sub-block s's value i in qs[32*(s/2) + i], low nibble for even s; its 6-bit scale and
 * minimum packed in ``scales`` (k_scale_min). Q5_K: the same with the fifth bit of value i of
 * sub-block s in bit s of qh[i]. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[128];
} gguf_q4_k;
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];
    uint8_t qs[128];
} gguf_q5_k;
/* Q6_K: input 128h + 32c + i (c = 0..3) has its low nibble in ql[64h + 32(c%2) + i] (low for c < 2)
 * and its two high bits at bit 2c of qh[32h + i]; input n's scale is scales[n/16]. */
typedef struct {
    uint8_t ql[128];
    uint8_t qh[64];
    int8_t scales[16];
    uint16_t d;
} gguf_q6_k;
static_assert(sizeof(gguf_q4_0) == 18, "a Q4_0 block is 18 bytes");
static_assert(sizeof(gguf_q4_1) == 20, "a Q4_1 block is 20 bytes");
static_assert(sizeof(gguf_q8_0) == 34, "a Q8_0 block is 34 bytes");
static_assert(sizeof(gguf_q4_k) == 144, "a Q4_K block is 144 bytes");
static_assert(sizeof(gguf_q5_k) == 176, "a Q5_K block is 176 bytes");
static_assert(sizeof(gguf_q6_k) == 210, "a Q6_K block is 210 bytes");

/* ---- the engine's cells ------------------------------------------------------------------------ */

/* Cell kinds: what a cell stores per output row (its scales, its values' width, how many inputs). */
enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_Q4K = 2, KIND_Q5K = 3, KIND_Q6K = 4, KINDS };

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
/* Q4_K and Q5_K: 16 rows x one super-block. Each row's fp16 d and dmin; per sub-block j the 16 rows'
 * 6-bit scales sc[j] and minimums mn[j] (16 bytes: one vector load gives a tile's); per sub-block the
 * low four bits of 16 x 32 values as a Q4 cell's q area (q4_slot); Q5_K also each value's fifth bit
 * in a plane of 64 bytes per sub-block (hi_slot). */
typedef struct {
    uint16_t d[TILE], dmin[TILE];
    uint8_t sc[QK_K / QK][TILE], mn[QK_K / QK][TILE];
    uint8_t q[QK_K / QK][TILE * QK / 2];
} cell_q4k;
typedef struct {
    uint16_t d[TILE], dmin[TILE];
    uint8_t sc[QK_K / QK][TILE], mn[QK_K / QK][TILE];
    uint8_t q[QK_K / QK][TILE * QK / 2];
    uint8_t hi[QK_K / QK][TILE * QK / 8];
} cell_q5k;
/* Q6_K: 16 rows x one super-block. Per 16 inputs the 16 rows' signed scales, each row's fp16 d, per
 * sub-block the low four bits of u = q + 32 as a Q4 cell's q area and the two high bits in a plane
 * of 128 bytes (hi_slot). */
typedef struct {
    int8_t sc[QK_K / 16][TILE];
    uint16_t d[TILE];
    uint8_t q[QK_K / QK][TILE * QK / 2];
    uint8_t hi[QK_K / QK][TILE * QK / 4];
} cell_q6k;
static_assert(sizeof(cell_q4) == 320, "a Q4 cell is 320 bytes");
static_assert(sizeof(cell_q8) == 544, "a Q8 cell is 544 bytes");
static_assert(sizeof(cell_q4k) == 2368, "a Q4_K cell is 2368 bytes");
static_assert(sizeof(cell_q5k) == 2880, "a Q5_K cell is 2880 bytes");
static_assert(sizeof(cell_q6k) == 3360, "a Q6_K cell is 3360 bytes");
static_assert(offsetof(cell_q4, q) == 64 && offsetof(cell_q8, q) == 32, "cells hold their scales first");
static_assert(offsetof(cell_q4k, q) == offsetof(cell_q5k, q), "Q4_K and Q5_K cells share their first parts");

/* A cell kind the code does not know: a bug, never a wrong answer (each switch over kinds ends here). */
#define UNKNOWN_KIND() __builtin_trap()

/* The kernels' helpers and row loops, each specialised per cell kind and row count at its call: forced
 * inline, or the compiler keeps one copy taking the kind at run time (measured: it did, for 15 copies). */
#define KERNEL_INLINE inline __attribute__((always_inline))

static KERNEL_INLINE size_t cell_bytes(int kind) {
    switch (kind) {
    case KIND_Q4: return sizeof(cell_q4);
    case KIND_Q8: return sizeof(cell_q8);
    case KIND_Q4K: return sizeof(cell_q4k);
    case KIND_Q5K: return sizeof(cell_q5k);
    case KIND_Q6K: return sizeof(cell_q6k);
    default: UNKNOWN_KIND();
    }
}

/* Blocks of 32 inputs per cell: 1, or the 8 sub-blocks of a K-quant's super-block. */
static KERNEL_INLINE int cell_blocks(int kind) {
    switch (kind) {
    case KIND_Q4: case KIND_Q8: return 1;
    case KIND_Q4K: case KIND_Q5K: case KIND_Q6K: return QK_K / QK;
    default: UNKNOWN_KIND();
    }
}

/* Bits of each value kept beside its low nibble (hi_slot's planes): Q5_K 1, Q6_K 2, others 0. */
static KERNEL_INLINE int high_bits(int kind) {
    switch (kind) {
    case KIND_Q4: case KIND_Q8: case KIND_Q4K: return 0;
    case KIND_Q5K: return 1;
    case KIND_Q6K: return 2;
    default: UNKNOWN_KIND();
    }
}

/* Layouts: how a cell's values are ordered for the products that read them (quant.Numerics.layout).
 *  LAYOUT_BF16: bfloat16 dot products (vdpbf16ps, AMX tdpbf16ps) take pairs of k per output row;
 *  LAYOUT_F32:  float32 FMAs take one k at a time for every output row (16 lanes);
 *  LAYOUT_INT8: int8 dot products (vpdpbusd, AMX tdpbsud) take quads of k per output row. */
enum { LAYOUT_BF16 = 0, LAYOUT_F32 = 1, LAYOUT_INT8 = 2, LAYOUTS };

/* Where q(row r of the tile, k of the block) lives in a Q4 cell's q area (also each sub-block's of a
 * K-quant cell): (byte, shift). */
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

/* Where bit b (0 .. bits-1) of the high part (value >> 4) of q(r, k) lives in a sub-block's plane
 * of 64*bits bytes (Q5_K: bits 1, Q6_K: 2), placed for the kernel that reads it:
 *  LAYOUT_F32:  byte 16*(k / (8/bits)) + r, bit bits*(k % (8/bits)) + b: the bytes of 16 rows for a
 *               few k, widened to 16 lanes and shifted into place;
 *  LAYOUT_INT8: per quad g = k/4 and bit b a 64-bit mask over the quad's positions 4r + k%4 (the
 *               order of vpdpbusd's bytes): an AVX-512 mask register adds 16 << b where set;
 *  LAYOUT_BF16: per pair p = k/2 and bit b a 32-bit mask over the pair's words 2r + k%2. */
static inline void hi_slot(int layout, int bits, int r, int k, int b, int *byte, int *bit) {
    int pos;
    if (layout == LAYOUT_F32) {
        int per = 8 / bits;
        *byte = 16 * (k / per) + r;
        *bit = bits * (k % per) + b;
        return;
    }
    if (layout == LAYOUT_INT8) {
        pos = 64 * (bits * (k >> 2) + b) + 4 * r + (k & 3);
    } else {
        pos = 32 * (bits * (k >> 1) + b) + 2 * r + (k & 1);
    }
    *byte = pos >> 3;
    *bit = pos & 7;
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

/* One file block read out: what a cell keeps of one row. */
typedef struct {
    uint16_t d, m; /* Q4/Q8: the block's fp16 scale and minimum (Q8: 0); K-quants: the fp16 d and dmin */
    int sc[QK_K / 16]; /* Q4_K/Q5_K: the 8 sub-blocks' 6-bit scales; Q6_K: the 16 signed scales (per 16 inputs) */
    int mn[QK_K / QK]; /* Q4_K/Q5_K: the 8 sub-blocks' 6-bit minimums */
    int q[QK_K];       /* Q4 0..15, Q8 -128..127, Q4_K 0..15, Q5_K 0..31, Q6_K u = q + 32 in 0..63 */
} block_values;

/* A natively computed GGUF type: its id, name, inputs and bytes per file block, the cell kind it
 * repacks into (a cell: 16 rows x one file block), and how one block reads out. */
typedef struct {
    int ggml_type;
    const char *name;
    int inputs; /* 32, or a K-quant's 256 */
    int block_bytes;
    int kind;
    void (*read)(const uint8_t *block, block_values *out);
} block_type;

extern const block_type block_types[];
extern const int block_type_count;
const block_type *find_block_type(int ggml_type); /* NULL: not native */

#define MAX_PARTS 4

/* A weight [N, K] repacked: ceil(N/16) tiles of K/(32 * cell_blocks) cells, tile-major; rows past N
 * are zero. Or a weight stacked from parts of different kinds along the output rows (a Q4_K_M
 * layer's q/k in Q4_K and v in Q6_K): ``parts`` > 0, no cells of its own, part i (a weight of one
 * kind) giving rows part_row0[i] .. part_row0[i] + part[i]->N - 1; a product prepares the rows once
 * for all of them (matmul.c). ``kind`` and ``ggml_type`` are then -1. */
typedef struct packed_weight {
    int ggml_type, kind, layout;
    int round_rows; /* LAYOUT_F32 only: rows rounded to bfloat16 values first (bfloat16 emulated) */
    int N, K;
    uint8_t *cells; /* 64-byte aligned, owned */
    size_t bytes;   /* a stacked weight: its parts' */
    int parts;
    const struct packed_weight *part[MAX_PARTS];
    int part_row0[MAX_PARTS];
    /* Products of this weight over ``one_thread_rows`` rows or fewer run on one thread, when
     * ``one_thread_rows_set`` (measured for the model on this machine: costs.few_row_threads);
     * unset, the ISA's default (matmul.c). The thread count never changes a result. */
    int one_thread_rows, one_thread_rows_set;
} packed_weight;

/* Tile ``tile``'s cell ``cell`` (inputs cell * 32 * cell_blocks ..). */
static KERNEL_INLINE const uint8_t *cell_at(const packed_weight *w, int tile, int cell) {
    return w->cells + ((size_t)tile * (w->K / (QK * cell_blocks(w->kind))) + cell) * cell_bytes(w->kind);
}

/* The cell holding block b (32 inputs) of tile t, and b's sub-block within it. */
static KERNEL_INLINE const uint8_t *block_cell(const packed_weight *w, int tile, int b, int *sub) {
    int per = cell_blocks(w->kind);
    *sub = b % per;
    return cell_at(w, tile, b / per);
}

/* The low-nibble area of sub-block j of a cell of a nibble kind (Q4, Q4_K, Q5_K, Q6_K), and its
 * high-bit plane (NULL for Q4, Q4_K). */
static KERNEL_INLINE const uint8_t *nibbles_of(int kind, const uint8_t *cell, int j, const uint8_t **hi) {
    switch (kind) {
    case KIND_Q4: *hi = NULL; return ((const cell_q4 *)cell)->q;
    case KIND_Q4K: *hi = NULL; return ((const cell_q4k *)cell)->q[j];
    case KIND_Q5K: *hi = ((const cell_q5k *)cell)->hi[j]; return ((const cell_q5k *)cell)->q[j];
    case KIND_Q6K: *hi = ((const cell_q6k *)cell)->hi[j]; return ((const cell_q6k *)cell)->q[j];
    default: UNKNOWN_KIND();
    }
}

/* Row r's scales for sub-block j of a cell, as float32 (exact): d[h] multiplies inputs 16h .. 16h+15
 * (equal but for Q6_K), *mn is the term added per unit of the block's input sum (0 for Q8, Q6_K:
 * their kernels add none). */
static inline void block_scales(int kind, const uint8_t *cell, int r, int j, float d[2], float *mn) {
    switch (kind) {
    case KIND_Q4: {
        const cell_q4 *c = (const cell_q4 *)cell;
        d[0] = d[1] = fp16_to_float(c->d[r]);
        *mn = fp16_to_float(c->m[r]);
        return;
    }
    case KIND_Q8:
        d[0] = d[1] = fp16_to_float(((const cell_q8 *)cell)->d[r]);
        *mn = 0.0f;
        return;
    case KIND_Q4K: case KIND_Q5K: { /* the two cells share these fields' places */
        const cell_q4k *c = (const cell_q4k *)cell;
        d[0] = d[1] = fp16_to_float(c->d[r]) * (float)c->sc[j][r];
        *mn = -(fp16_to_float(c->dmin[r]) * (float)c->mn[j][r]);
        return;
    }
    case KIND_Q6K: {
        const cell_q6k *c = (const cell_q6k *)cell;
        d[0] = fp16_to_float(c->d[r]) * (float)c->sc[2 * j][r];
        d[1] = fp16_to_float(c->d[r]) * (float)c->sc[2 * j + 1][r];
        *mn = 0.0f;
        return;
    }
    default: UNKNOWN_KIND();
    }
}

/* Whether a kind's products add mn * (the block's input sum). */
static KERNEL_INLINE int has_minimum(int kind) {
    switch (kind) {
    case KIND_Q4: case KIND_Q4K: case KIND_Q5K: return 1;
    case KIND_Q8: case KIND_Q6K: return 0;
    default: UNKNOWN_KIND();
    }
}

/* Row r's stored integer at input k of sub-block j: Q4, Q4_K, Q5_K q; Q8 q; Q6_K u (= q + 32). */
static inline int stored_value(int kind, int layout, const uint8_t *cell, int r, int j, int k) {
    int byte, shift, bit, bits = high_bits(kind);
    const uint8_t *q, *hi = NULL;
    switch (kind) {
    case KIND_Q4: q = ((const cell_q4 *)cell)->q; break;
    case KIND_Q8: return q8_load(layout, ((const cell_q8 *)cell)->q[q8_slot(layout, r, k)]);
    case KIND_Q4K: q = ((const cell_q4k *)cell)->q[j]; break;
    case KIND_Q5K: q = ((const cell_q5k *)cell)->q[j], hi = ((const cell_q5k *)cell)->hi[j]; break;
    case KIND_Q6K: q = ((const cell_q6k *)cell)->q[j], hi = ((const cell_q6k *)cell)->hi[j]; break;
    default: UNKNOWN_KIND();
    }
    q4_slot(layout, r, k, &byte, &shift);
    int value = (q[byte] >> shift) & 0x0f;
    for (int b = 0; b < bits; b++) {
        hi_slot(layout, bits, r, k, b, &byte, &bit);
        value |= ((hi[byte] >> bit) & 1) << (4 + b);
    }
    return value;
}

/* The integer a kernel multiplies by d: the stored one, less Q6_K's offset 32. */
static inline int product_value(int kind, int layout, const uint8_t *cell, int r, int j, int k) {
    int v = stored_value(kind, layout, cell, r, j, k);
    return kind == KIND_Q6K ? v - 32 : v;
}

size_t packed_bytes(int kind, int N, int K);
void repack(packed_weight *w, const block_type *type, const uint8_t *src, const int64_t *order, int count, int row0);
void dequant_rows(const packed_weight *w, const int64_t *rows, int count, float *out);
void gather_rows(const packed_weight *w, const int64_t *rows, int count, packed_weight *dst);

#endif
