/* tierspec's pass engine: what its files share. docs/engine.md says what each path computes.
 *
 *   blocks.h, blocks.c   GGUF block formats, the engine's cells, repacking
 *   cpu.c                the CPU's features, read once; the TIERSPEC_ENGINE_ISA cap; the AMX probe
 *   threads.c            the thread pool
 *   kernels_ref.c        the plain-C reference of every kernel (also the portable path)
 *   kernels_avx2.c, kernels_avx512.c, kernels_vnni.c, kernels_avx512bf16.c, kernels_amx.c
 *                        the vector and tile kernels, each file compiled for its ISA by target attributes
 *   matmul.c             products: rows prepared once, tiles shared among threads
 *   layer.c              the decoder layer over a pass's rows (one runner for solo and batched passes)
 *   binding.c            the Python module
 *
 * Two properties the decode loop relies on, kept by construction (the row contract):
 *  - Every output element is computed by one thread in an order fixed by the weights' shape and the
 *    CPU's kernel path, never by the number of rows in the pass or by which thread runs it, so a
 *    token's results do not depend on the other rows of its pass.
 *  - Attention walks each query's visible keys in logical order (the cached context, then the new
 *    tokens it sees, in pass order), whatever slots they sit in, so a token-tree node gets exactly
 *    the result of a chain pass of its path.
 */
#ifndef TIERSPEC_ENGINE_H
#define TIERSPEC_ENGINE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "blocks.h"
#include "keyed_scan.h" /* the keyed draws' statuses (KEYED_FOUND, KEYED_NAN, KEYED_ELSEWHERE) */

#if defined(__x86_64__) || defined(_M_X64)
#define QE_X86 1
#else
#define QE_X86 0
#endif

/* ---- the CPU (cpu.c) ------------------------------------------------------------------------- */

/* Kernel paths, each needing every feature of the ones below it. */
enum {
    ISA_PORTABLE = 0, /* plain C */
    ISA_AVX2,         /* AVX2 + FMA + F16C, the OS saving YMM state */
    ISA_AVX512,       /* AVX-512 F/BW/VL/DQ, the OS saving ZMM and mask state */
    ISA_AVX512VNNI,   /* + AVX512-VNNI (vpdpbusd) */
    ISA_AVX512BF16,   /* + AVX512-BF16 (vdpbf16ps) */
    ISA_AMX,          /* + AMX tiles (BF16 and INT8), granted by the OS and probed */
    ISAS
};
extern const char *const isa_names[ISAS];

typedef struct {
    /* what CPUID lists */
    int avx2, fma, f16c, avx512f, avx512bw, avx512vl, avx512dq, avx512cd, avx512vnni, avx512bf16, amx_tile, amx_bf16, amx_int8;
    /* what the OS saves on a context switch (XCR0 read by xgetbv) */
    int os_ymm, os_zmm, os_tiles;
    int amx;                /* the tile state granted (arch_prctl) and a tile product run in a forked child */
    char amx_reason[200];   /* why AMX is not used ("" when it is) */
    int best;               /* the highest path this CPU and OS run */
    int cap;                /* TIERSPEC_ENGINE_ISA's path (ISA_AMX when unset) */
    int cap_set;            /* whether TIERSPEC_ENGINE_ISA was set */
    int level;              /* the path in use: min(best, cap); tests may lower it (select_isa) */
} cpu_features;

extern cpu_features cpu;

/* Reads the CPU once (at import). Returns 0, or -1 with ``error`` saying what is wrong with
 * TIERSPEC_ENGINE_ISA (an unknown value is refused, never ignored). */
int cpu_init(char *error, size_t size);
int isa_by_name(const char *name); /* -1: unknown */

/* ---- threads (threads.c) ---------------------------------------------------------------------- */

typedef void (*task_fn)(void *arg, int chunk);
/* fn(arg, c) for c in 0..chunks-1 on up to ``threads`` threads, the caller among them. */
void run_parallel(task_fn fn, void *arg, int chunks, int threads);
unsigned flush_denormals(void);
void restore_denormals(unsigned previous);

/* ---- kernels ---------------------------------------------------------------------------------- */

/* A product's operands as the tile kernels read them. */
typedef struct {
    const packed_weight *w;
    const void *x;        /* rows as the layout takes them: bf16 [M, K], float [M, K] or int8 [M, K] */
    const float *sums;    /* BF16, F32: each row's block sums [M, K/32]; INT8: block scales [M, K/32] */
    const int32_t *isums; /* INT8: block sums of the 8-bit values [M, K/32] */
    const int32_t *half_isums; /* INT8, Q6_K: sums of the 8-bit values per 16 [M, K/16] (its two scales a block) */
    const float *offsets; /* INT8: s * (float)isum per row and block [M, K/32], the factor of a block's minimum
                           * (Q4, Q4_K, Q5_K): made once a product, not once a tile of 16 outputs */
    int M;
    float *out;
    int ldo;        /* out's row stride (floats) */
    int accumulate; /* out += result instead of out = result */
} matmul_args;

/* Outputs of tile t (16 output rows) for rows m0 .. m0 + mt - 1 (mt <= the kernel's ``rows``). */
typedef void (*tile_fn)(const matmul_args *a, int t, int m0, int mt);

typedef struct {
    tile_fn run;
    int rows;  /* the most rows one call takes */
    int isa;   /* the path it belongs to */
    /* row groups of fewer than few_below rows take ``few`` instead, few_rows rows a call: only a
     * kernel that gives the same bits (the int8 products: integer dot products are exact in any order) */
    tile_fn few;
    int few_below, few_rows;
    void (*enter)(void), (*leave)(void); /* around a thread's run of tiles (AMX: the tile configuration) */
} tile_kernel;

/* A cache's KV tables: per layer int64 [KV_COLUMNS]: the key and value buffers' addresses, their
 * capacity in slots, and the bytes of one element: 4 (float32) or 2 (float16, KV_HALF). */
#define KV_COLUMNS 4
#define KV_HALF 2

/* float16 keys and values: what a pass writes is its float32 entry clamped to float16's largest
 * finite value (+-65504), rounded to nearest even, a result below float16's smallest normal value
 * (2^-14) made a signed zero (no float16 subnormal is ever stored, so no path's reading depends on
 * how its CPU treats them); a NaN stays a NaN. Every path stores and reads the same bits: the
 * reference here, F16C's conversions on the vector paths (tests compare them). */
uint16_t half_from_float(float f);
float float_from_half(uint16_t h);

/* One sequence's cache and mask in a layer, as its rows' attention reads them. */
typedef struct {
    int heads, kv_heads, head_dim;
    const void *keys, *values; /* [kv_heads, cap, D]: float32, or float16 where half */
    int half;
    int cap, start, n;          /* n new rows at slots start .. start + n - 1 */
    const uint8_t *attends;     /* NULL: a chain; [n, n] among the new rows; [n, start + n] when every_slot */
    int every_slot;
    /* a sliding window (0: none): a query at position p sees keys at positions > p - window; a cached
     * slot s < start holds position s, new row j position positions[j] (NULL: start + j) */
    int window;
    const int64_t *positions;
    float scale;   /* multiplies q.k (1/sqrt(D) unless the model gives its own) */
    float softcap; /* > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax */
} attention_view;

/* The body of a vector path's attend (kernel_set.attend): query heads head0 .. head0 + group - 1 in
 * calls of at most ``per_call`` heads to ``kernel``, the path's inline kernel, which takes the head
 * width in vectors of ``lanes`` floats and the cache's element type (float16 or float32) as
 * compile-time constants for the common widths (query and sums in registers, loops unrolled; Phi-3's
 * 96-wide heads took the plain-C loop before, a fifth of its one-row pass at 256 cached tokens) and
 * the width read at run time for the others (160, 192, 224). Returns 0 for a width no vector path
 * takes (any but a multiple of 32 up to 256): the reference runs. */
#define ATTEND_WIDTH_SWITCH(kernel, lanes, half)                                                         \
    switch (D) {                                                                                        \
    case 32: kernel(a, q, out, h, part, scores, slots, count, 32 / (lanes), half); break;               \
    case 64: kernel(a, q, out, h, part, scores, slots, count, 64 / (lanes), half); break;               \
    case 96: kernel(a, q, out, h, part, scores, slots, count, 96 / (lanes), half); break;               \
    case 128: kernel(a, q, out, h, part, scores, slots, count, 128 / (lanes), half); break;             \
    case 256: kernel(a, q, out, h, part, scores, slots, count, 256 / (lanes), half); break;             \
    default: kernel(a, q, out, h, part, scores, slots, count, D / (lanes), half); break;                \
    }
#define ATTEND_BY_WIDTH(kernel, lanes, per_call)                                                         \
    int D = a->head_dim;                                                                                \
    if (D % 32 != 0 || D > 256) return 0;                                                               \
    for (int h = head0; h < head0 + group; h += (per_call)) {                                           \
        int part = head0 + group - h < (per_call) ? head0 + group - h : (per_call);                     \
        if (a->half) {                                                                                  \
            ATTEND_WIDTH_SWITCH(kernel, lanes, 1)                                                       \
        } else {                                                                                        \
            ATTEND_WIDTH_SWITCH(kernel, lanes, 0)                                                       \
        }                                                                                               \
    }                                                                                                   \
    return 1;

/* The body of a vector path's attend_rows: ``kernel`` (the path's inline kernel, taking the head width in
 * vectors of ``lanes`` floats and the cache's element type as constants) by head width as
 * ATTEND_WIDTH_SWITCH's, the group whole (the rows' and heads' state is in scratch, not registers);
 * returns 0 for a width no vector path takes. */
#define ATTEND_ROWS_CASE(kernel, lanes, width, half) \
    case width: kernel(a, q, out, j0, rows, head0, group, scratch, (width) / (lanes), half); break;
#define ATTEND_ROWS_WIDTH_SWITCH(kernel, lanes, half)                                         \
    switch (D) {                                                                              \
        ATTEND_ROWS_CASE(kernel, lanes, 32, half)                                             \
        ATTEND_ROWS_CASE(kernel, lanes, 64, half)                                             \
        ATTEND_ROWS_CASE(kernel, lanes, 96, half)                                             \
        ATTEND_ROWS_CASE(kernel, lanes, 128, half)                                            \
        ATTEND_ROWS_CASE(kernel, lanes, 256, half)                                            \
    default: kernel(a, q, out, j0, rows, head0, group, scratch, D / (lanes), half); break;    \
    }
#define ATTEND_ROWS_BY_WIDTH(kernel, lanes)                                                   \
    int D = a->head_dim;                                                                      \
    if (D % 32 != 0 || D > 256) return 0;                                                     \
    if (a->half) {                                                                            \
        ATTEND_ROWS_WIDTH_SWITCH(kernel, lanes, 1)                                            \
    } else {                                                                                  \
        ATTEND_ROWS_WIDTH_SWITCH(kernel, lanes, 0)                                            \
    }                                                                                         \
    return 1;

/* The slots a query row sees, in logical order: the cached context, then the new tokens it sees
 * (within the view's window). */
int visible_slots(const attention_view *a, int row, int *slots);

enum { OP_PREPARE_F32, OP_PREPARE_BF16, OP_PREPARE_INT8, OP_EXP, OP_RMS_NORM, OP_ATTEND, OP_STORE_HALF, OP_FIRST_MAX,
       OP_ATTEND_ROWS, OP_KEYED_MAX, OPS };

/* Keys and values a vector path's attend_rows widens at a time (a block of values covers whole
 * (even, odd) pairs), and the scratch bytes it needs for ``rows`` rows of ``group`` heads of width D
 * whose last row sees ``keys`` keys: the widened blocks, every row's and head's scores, value sums
 * (even and odd), running maxima [16] and 1 / sum, and room to align. */
#define ATTEND_ROWS_KEY_BLOCK 16
#define ATTEND_ROWS_VALUE_BLOCK 32
static inline size_t attend_rows_scratch(int rows, int group, int keys, int D) {
    return ((size_t)(ATTEND_ROWS_KEY_BLOCK + ATTEND_ROWS_VALUE_BLOCK) * D +
            (size_t)rows * group * ((size_t)keys + 2 * (size_t)D + 16 + 1)) * 4 + 64;
}

typedef struct {
    tile_kernel tile[LAYOUTS][KINDS];
    /* rows for LAYOUT_F32 (rounded to bfloat16 values when round_bf16) and LAYOUT_BF16, with each
     * row's block sums; rows for LAYOUT_INT8: 8 bits per value, a scale and a sum per block */
    void (*prepare_f32)(int round_bf16, const float *x, int M, int K, float *xbuf, float *sums);
    void (*prepare_bf16)(const float *x, int M, int K, uint16_t *xbuf, float *sums);
    void (*prepare_int8)(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums);
    void (*exp_inplace)(float *v, int count);
    void (*rms_norm)(const float *x, const float *w, float eps, int n, float *out);
    /* query heads head0 .. head0 + group - 1 of one query row, all reading one kv head, over their
     * visible ``slots`` (q [heads * D] rotated, out [heads * D], scores: scratch [group, count]);
     * each head gets exactly what it gets alone (a group only shares the loads of its keys and
     * values); returns 0 where it has no kernel for the head width (then the reference runs) */
    int (*attend)(const attention_view *a, const float *q, float *out, int head0, int group, float *scores,
                  const int *slots, int count);
    /* ``attend`` for ``rows`` consecutive query rows j0 .. j0 + rows - 1 of a chain view (no mask, and
     * a window, if any, that cuts none of their keys: row j sees slots 0 .. start + j), query heads head0 .. head0 + group - 1
     * of one kv head; q and out [rows, heads * D]; scratch: attend_rows_scratch(...) bytes. Each row
     * and head gets exactly what ``attend`` gives it alone (its operations in the same order): the rows
     * only share the loads of a block of keys and values, widened to float32 once for all of them
     * (a prefill's attention read every key again for every row). NULL on a path without it, and
     * returns 0 for a head width it does not cover: then each row runs ``attend``. */
    int (*attend_rows)(const attention_view *a, const float *q, float *out, int j0, int rows, int head0, int group,
                       float *scratch);
    /* n float32 values stored as float16 (half_from_float's bits) */
    void (*store_half)(const float *x, uint16_t *out, int n);
    /* the index of the first of the largest of x[0 .. n - 1] (n >= 1) and that value in *top; -1 where
     * one is a NaN (*top then undefined): an argmax's first maximum, as every path gives it */
    int64_t (*first_max)(const float *x, int64_t n, float *top);
    /* the perturbed maximum of x[0 .. n - 1] (n >= 1), the scores of tokens token0 .. token0 + n - 1, under
     * the Gumbel noise of ``key``: keyed_scan.h's keyed_stretch_plain / _avx2 / _avx512, the largest
     * fl(x_i + g(token0 + i)) in *value and its token in *token, the first of equal ones; returns KEYED_FOUND,
     * or KEYED_NAN / KEYED_ELSEWHERE (then *value and *token are unset). Every path gives the same bits. */
    int (*keyed_max)(const float *x, int64_t n, int64_t token0, uint64_t key, float *value, int64_t *token);
    /* rows per chunk of a long pass (layer.c's run_pass): PASS_ROWS, or what the tile kernels amortise
     * their per-call work over (AMX: each block's B tile is made once per call, for all its rows) */
    int pass_rows;
    int isa[OPS]; /* which path serves each of the functions above (reports) */
} kernel_set;


/* Rows per chunk of a long pass where no path asks for more (chosen on the default model's prefill,
 * benchmarks/prefill.py); a row's results never depend on the chunking. */
#define PASS_ROWS 64

/* The kernels in use, composed by select_kernels from every path up to cpu.level. */
extern kernel_set kernels;
void select_kernels(int level);

/* Each path's installer overwrites the entries it provides. */
void install_portable(kernel_set *k);
void install_avx2(kernel_set *k);
void install_avx512(kernel_set *k);
void install_vnni(kernel_set *k);
void install_avx512bf16(kernel_set *k);
void install_amx(kernel_set *k);
int install_emulated_amx(kernel_set *k); /* tests: the AMX kernels over emulated tiles; 0 without AVX-512 */
int amx_selftest(void);                  /* a tile product of known numbers (the probe's child) */

/* The reference kernels (kernels_ref.c), also called by the vector paths for head widths or tails
 * they do not cover. */
float exp_ref(float x);
void exp_inplace_ref(float *v, int count);
float sum_in_order(const float *v, int count);
/* scores[i] = cap * tanh(scores[i] / cap) (tanh_from_exp over exp_ref): every path calls this one, so
 * soft-capped scores are the same bits on every path */
void softcap_scores(float *scores, int count, float cap);
int attend_ref(const attention_view *a, const float *q, float *out, int head0, int group, float *scores,
               const int *slots, int count);
void tile_ref(const matmul_args *a, int t, int m0, int mt);

/* Tile outputs written (or added) to out for row m of the pass, tile t. */
static inline void store_tile(const matmul_args *a, int m, int t, const float *vals) {
    float *dst = a->out + (size_t)m * a->ldo + (size_t)t * TILE;
    int count = a->w->N - t * TILE < TILE ? a->w->N - t * TILE : TILE;
    if (a->accumulate)
        for (int i = 0; i < count; i++) dst[i] += vals[i];
    else
        for (int i = 0; i < count; i++) dst[i] = vals[i];
}

/* exp(x) by Cephes' polynomial after a range reduction by ln 2 (~1 ulp), x clamped above at 88.376
 * and 0 below -87.336 (where the result would be subnormal): every path does the same operations,
 * so every element gets the same value whichever path or lane computes it. */
#define EXP_HI 88.3762626647949f
#define EXP_LO -87.3365447504f
#define EXP_C0 1.9875691500e-4f
#define EXP_C1 1.3981999507e-3f
#define EXP_C2 8.3334519073e-3f
#define EXP_C3 4.1665795894e-2f
#define EXP_C4 1.6666665459e-1f
#define EXP_C5 5.0000001201e-1f
#define LOG2E 1.44269504088896341f
#define LN2_HI -0.693359375f
#define LN2_LO 2.12194440e-4f

/* tanh(x) given e = exp(-2|x|) as the paths' exp computes it (the same bits on every path), so
 * tanh is the same on every path too: Cephes' tanhf, below |x| = 0.625 its odd polynomial in x
 * (e unused), above (1 - e) / (1 + e) with x's sign (no overflow: e <= 1). Plain products and sums
 * (the build does not contract them): the same operations wherever it is inlined. */
#define TANH_SMALL 0.625f
#define TANH_P0 -5.70498872745e-3f
#define TANH_P1 2.06390887954e-2f
#define TANH_P2 -5.37397155531e-2f
#define TANH_P3 1.33314422036e-1f
#define TANH_P4 -3.33332819422e-1f
static inline float tanh_from_exp(float x, float e) {
    if (x < TANH_SMALL && x > -TANH_SMALL) {
        float s = x * x;
        float p = (((TANH_P0 * s + TANH_P1) * s + TANH_P2) * s + TANH_P3) * s + TANH_P4;
        return p * s * x + x;
    }
    float t = (1.0f - e) / (1.0f + e);
    return x < 0.0f ? -t : t;
}

/* GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))): the argument of tanh */
#define GELU_BETA 0.7978845608028654f
#define GELU_KAPPA 0.044715f
static inline float gelu_tanh_argument(float x) { return GELU_BETA * (x + GELU_KAPPA * x * x * x); }

/* How far ahead (in cells, ~15 KB) the kernels ask for weights: measured best of 2-96 (Zen 5). */
#define PREFETCH_CELLS 48

/* ---- products (matmul.c) ---------------------------------------------------------------------- */

/* out (+)= x W^T for x [M, K] float32 on ``threads`` threads. */
void linear(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int threads);
/* ``linear``, and each row's first maximum among its N outputs in maxima[M] (int64; -1 for a row holding a
 * NaN): each thread finds its chunk's (``first_max``) right after computing the chunk, while its outputs are
 * in that core's cache, and the chunks' answers are joined — the first column of the largest, as an argmax
 * over the written row gives it. maxima NULL: ``linear``. */
void linear_maxima(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int threads,
                   int64_t *maxima);
/* Keyed draws of an LM head's rows (sampled decoding's tokens, tierspec/sampling.py's ``keyed_tokens``):
 * for each row m with keyed[m], the token argmax_v fl(out[m, v] / temperature[m] + g_m(v)) under the Gumbel
 * noise of keys[m], the first of equal maxima — what the keyed-noise extension gives the row after the
 * pass, bit for bit. */
typedef struct {
    const uint64_t *keys;
    const float *temperature;
    const uint8_t *keyed;
} row_draws;
/* ``linear_maxima`` (maxima may be NULL), and each keyed row's draw in tokens[M] (int64; -1 for a row
 * holding a NaN, -2 for a row not keyed or left to the extension: KEYED_ELSEWHERE): each thread draws its
 * chunk's perturbed maximum (``keyed_max``, the chunk divided by the temperature first where it is not 1)
 * right after computing the chunk, and the chunks' answers are joined as the maxima's are. */
void linear_draws(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int threads,
                  int64_t *maxima, const row_draws *draws, int64_t *tokens);
/* Products of ``w`` over this many rows or fewer run on one thread (its measured setting, else the ISA's default). */
int one_thread_rows(const packed_weight *w);

/* ---- layers (layer.c) ------------------------------------------------------------------------ */

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 }; /* the MLP's gate: silu(g) * u or gelu_tanh(g) * u */

/* A decoder layer: its four products (q/k/v stacked, o, gate/up stacked, down), its norms and
 * biases (owned copies; NULL where the architecture has none) and shapes. Plain Llama has only the
 * two norms in front of its units; the others add, in this order of the computation:
 *   qkv_bias  [(heads + 2 kv_heads) D] added to the q/k/v product (Qwen2)
 *   q_norm, k_norm  [D] an RMSNorm of each head's q and k, after the bias, before the rotation
 *                   (Qwen3, Gemma 3)
 *   the rotation of the first rotary_dims of each q and k head (rotate-half within them; Phi-3's
 *   partial rotary), by the pass's rotary table number rotary_table (Gemma 3: local and global)
 *   attention over the window (0: every earlier key), scores scaled by attention_scale, soft-capped
 *   when softcap > 0
 *   attention_out_norm, mlp_out_norm  [hidden] an RMSNorm of each unit's output before its residual
 *                   add (Gemma 3's post-norms)
 *   activation  the gate's function (ACT_SILU, ACT_GELU_TANH). */
typedef struct {
    const packed_weight *qkv, *o, *gate_up, *down;
    float *norm_in, *norm_post; /* [hidden]: before the attention unit, before the MLP unit */
    float *qkv_bias, *q_norm, *k_norm, *attention_out_norm, *mlp_out_norm;
    float eps;
    int hidden, heads, kv_heads, head_dim, inter;
    int activation, window, rotary_table, rotary_dims;
    float attention_scale, softcap;
} layer_desc;

/* One sequence's rows of a pass: rows row0 .. row0 + n - 1, written at its cache slots start ..
 * start + n - 1; kv [stack layers, 3]: each layer's key and value buffers ([kv_heads, cap, D]
 * float32) and capacity cap. */
typedef struct {
    int row0, n, start;
    const int64_t *kv;
    const uint8_t *attends; /* NULL: a chain; [n, n]; [n, start + n] when every_slot */
    int every_slot;
    const int64_t *positions; /* [n]: each row's position (a tree node's depth after start); NULL: start + j */
} segment_desc;

enum { UNIT_ATTENTION = 1, UNIT_MLP = 2 }; /* a layer's flags: which residual units run */

#define MAX_ROTARY_TABLES 4
typedef struct {
    const float *cos, *sin;
} rotary_table;

/* A pass: layers first .. last - 1 of ``layers`` over ``rows`` rows of ``count`` sequences. A solo
 * pass is a batch of one sequence. */
typedef struct {
    const layer_desc *const *layers;
    int first, last;
    const uint8_t *flags; /* per layer of the stack: UNIT_ATTENTION | UNIT_MLP, 0: skipped */
    const float *h_in;    /* [rows, H] */
    float *h_out;         /* [rows, H]: the last layer's output */
    int rows;
    /* rotary tables (a layer reads its rotary_table), each cos and sin [rows, rotary_dims]:
     * x*cos + roll(x, rotary_dims/2)*sin rotates a head's first rotary_dims by each row's position */
    const rotary_table *rotary;
    int rotary_count, rotary_dims;
    const segment_desc *segments;
    int count;
    const int *segment_of; /* [rows] */
    int threads;
    /* NULL, or per layer of the stack: NULL or a [rows, H] buffer that receives the residual rows
     * after that layer (its output, also where its units are skipped): hidden-state capture inside
     * the one call */
    float *const *captures;
} pass_desc;

void run_pass(const pass_desc *p);

/* The MLP's gate over rows: out [rows, inter] = act(g) * u for gate_up [rows, 2 inter] (g, then u). */
void activate_rows(int activation, const float *gate_up, int rows, int inter, float *out, int threads);

/* ---- scratch and profiles --------------------------------------------------------------------- */

typedef struct {
    void *buf;
    size_t size;
} scratch_t;
void *scratch_get(scratch_t *s, size_t bytes);

extern int profiling;
extern int64_t profile_ns[6]; /* whole stack calls, matrix products, attention, layer runs, rows attended in blocks,
                                attention tasks */
int64_t now_ns(void);

#endif
