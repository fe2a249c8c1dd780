/* The plain-C reference of every kernel, and the portable path (any CPU). The vector and tile paths
 * are tested against these (tests/models/test_engine_kernels.py): bitwise where they sum in the same
 * order (float32 rows, int8 rows, exp), within a stated tolerance where they do not (bfloat16 dot
 * products, whose vector and tile instructions sum pairs in their own order; norms and attention,
 * whose vector paths sum over lanes).
 *
 * Products, per output row r of a tile and block b of 32 inputs (blocks.h: w = d_h*v + mn for the
 * kinds with a minimum, d_h*v otherwise, d_h the scale of inputs 16h .. 16h+15 — one scale per block
 * but for Q6_K —, v the integer the kind multiplies, x the row as prepared):
 *  - LAYOUT_F32:  P_(k mod 4) += (d_h*v_k) * x_k for k = 0..31 in order (d_h*v is exact in float32),
 *                 then P_0 += mn * sum_k x_k (kinds with a minimum); the output (P_0 + P_1) + (P_2 + P_3);
 *  - LAYOUT_BF16: dot_h = sum_k v_k * x_k over each half with its own scale (the whole block where
 *                 d_0 = d_1; x rounded to bfloat16, v exact in it, float32 sums), then acc += dot_h * d_h,
 *                 acc += mn * sum_k x_k;
 *  - LAYOUT_INT8: dot_h = sum_k v_k * x8_k exactly in int32 (x8 = round(x / s), s = max|x| / 127 per
 *                 block; halves as above), then acc += dot_h * (d_h*s), acc += mn * (s * sum_k x8_k). */
#include <math.h>
#include <string.h>

#include "engine.h"
#include "keyed_scan.h"

/* Block sums in a fixed order: 8 lanes (element i of the block in lane i % 8, summed in order of i),
 * then the lanes pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)) — what the AVX2 code does, so they agree bitwise. */
static float block_sum(const float *v) {
    float lane[8];
    for (int j = 0; j < 8; j++) lane[j] = v[j];
    for (int i = 8; i < QK; i += 8)
        for (int j = 0; j < 8; j++) lane[j] += v[i + j];
    for (int j = 0; j < 4; j++) lane[j] += lane[j + 4];
    lane[0] += lane[2];
    lane[1] += lane[3];
    return lane[0] + lane[1];
}

static void prepare_f32_ref(int round_bf16, const float *x, int M, int K, float *xbuf, float *sums) {
    int KB = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            float *out = xbuf + (size_t)m * K + b * QK;
            for (int i = 0; i < QK; i++) {
                float v = x[(size_t)m * K + b * QK + i];
                out[i] = round_bf16 ? bf16_to_float(float_to_bf16(v)) : v;
            }
            sums[(size_t)m * KB + b] = block_sum(out);
        }
}

static void prepare_bf16_ref(const float *x, int M, int K, uint16_t *xbuf, float *sums) {
    int KB = K / QK;
    float block[QK];
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            for (int i = 0; i < QK; i++) {
                uint16_t h = float_to_bf16(x[(size_t)m * K + b * QK + i]);
                xbuf[(size_t)m * K + b * QK + i] = h;
                block[i] = bf16_to_float(h);
            }
            sums[(size_t)m * KB + b] = block_sum(block);
        }
}

/* Each block of 32 values as 8-bit integers q = round(x / s) with s = max|x| / 127 (as llama.cpp
 * rounds its activations), the scale s and the sum of q per block. Every step is exact or correctly
 * rounded, so the vector version gives the same bytes. */
static void prepare_int8_ref(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums) {
    int KB = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(v[i]));
            float scale = amax / 127.0f;
            int32_t total = 0;
            for (int i = 0; i < QK; i++) {
                int q = scale > 0.0f ? (int)nearbyintf(v[i] / scale) : 0;
                q = q > 127 ? 127 : q < -127 ? -127 : q;
                xq[(size_t)m * K + b * QK + i] = (int8_t)q;
                total += q;
            }
            scales[(size_t)m * KB + b] = scale;
            isums[(size_t)m * KB + b] = total;
        }
}

#define REF_ROWS 8

/* Block b of tile t: each row's scales d[h][r] (inputs 16h ..), mn[r] (0 where none) and v[k][r]. */
static void read_block(const packed_weight *w, int t, int b, float d[2][TILE], float mn[TILE], int v[QK][TILE]) {
    int j;
    const uint8_t *cell = block_cell(w, t, b, &j);
    for (int r = 0; r < TILE; r++) {
        float dr[2];
        block_scales(w->kind, cell, r, j, dr, &mn[r]);
        d[0][r] = dr[0], d[1][r] = dr[1];
        for (int k = 0; k < QK; k++) v[k][r] = product_value(w->kind, w->layout, cell, r, j, k);
    }
}

/* Whether a kind's blocks have two scales (one per 16 inputs), so dot products are taken per half. */
static int split_scales(int kind) {
    switch (kind) {
    case KIND_Q4: case KIND_Q8: case KIND_Q4K: case KIND_Q5K: return 0;
    case KIND_Q6K: return 1;
    default: UNKNOWN_KIND();
    }
}

/* LAYOUT_F32: four running sums per output, P_j over the inputs k = j (mod 4) of every block in
 * order, P_0 also taking each block's mn * sum x after the block; the output is (P_0 + P_1) +
 * (P_2 + P_3). Four independent chains per row, so a one-row product is not bound by the FMA's
 * latency. */
static void tile_f32_ref(const matmul_args *a, int t, int m0, int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK, minimum = has_minimum(w->kind);
    float p[REF_ROWS][TILE][4] = {{{0}}};
    for (int b = 0; b < KB; b++) {
        float d[2][TILE], mn[TILE];
        int v[QK][TILE];
        read_block(w, t, b, d, mn, v);
        for (int i = 0; i < mt; i++) {
            const float *x = (const float *)a->x + (size_t)(m0 + i) * w->K + (size_t)b * QK;
            float s = a->sums[(size_t)(m0 + i) * KB + b];
            for (int r = 0; r < TILE; r++) {
                for (int k = 0; k < QK; k++) p[i][r][k & 3] = fmaf(d[k / 16][r] * (float)v[k][r], x[k], p[i][r][k & 3]);
                if (minimum) p[i][r][0] = fmaf(mn[r], s, p[i][r][0]);
            }
        }
    }
    for (int i = 0; i < mt; i++) {
        float vals[TILE];
        for (int r = 0; r < TILE; r++) vals[r] = (p[i][r][0] + p[i][r][1]) + (p[i][r][2] + p[i][r][3]);
        store_tile(a, m0 + i, t, vals);
    }
}

/* LAYOUT_BF16 and LAYOUT_INT8: per block (or half block, where its halves have their own scales) a
 * dot product, then scaled into one running sum. */
static void tile_dot_ref(const matmul_args *a, int t, int m0, int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK, minimum = has_minimum(w->kind), halves = split_scales(w->kind) ? 2 : 1, span = QK / halves;
    float acc[REF_ROWS][TILE] = {{0}};
    for (int b = 0; b < KB; b++) {
        float d[2][TILE], mn[TILE];
        int v[QK][TILE];
        read_block(w, t, b, d, mn, v);
        for (int i = 0; i < mt; i++) {
            size_t row = (size_t)(m0 + i) * w->K + (size_t)b * QK;
            float s = a->sums[(size_t)(m0 + i) * KB + b];
            for (int r = 0; r < TILE; r++) {
                for (int h = 0; h < halves; h++) {
                    if (w->layout == LAYOUT_INT8) {
                        const int8_t *x = (const int8_t *)a->x + row;
                        int32_t dot = 0;
                        for (int k = span * h; k < span * (h + 1); k++) dot += v[k][r] * x[k];
                        acc[i][r] = fmaf((float)dot, d[h][r] * s, acc[i][r]);
                    } else {
                        const uint16_t *x = (const uint16_t *)a->x + row;
                        float dot = 0.0f;
                        for (int k = span * h; k < span * (h + 1); k++) dot = fmaf((float)v[k][r], bf16_to_float(x[k]), dot);
                        acc[i][r] = fmaf(dot, d[h][r], acc[i][r]);
                    }
                }
                if (minimum)
                    acc[i][r] = fmaf(mn[r], w->layout == LAYOUT_INT8 ? s * (float)a->isums[(size_t)(m0 + i) * KB + b] : s,
                                     acc[i][r]);
            }
        }
    }
    for (int i = 0; i < mt; i++) store_tile(a, m0 + i, t, acc[i]);
}

void tile_ref(const matmul_args *a, int t, int m0, int mt) {
    if (a->w->layout == LAYOUT_F32) tile_f32_ref(a, t, m0, mt);
    else tile_dot_ref(a, t, m0, mt);
}

float exp_ref(float x) {
    if (x < EXP_LO) return 0.0f;
    if (x > EXP_HI) x = EXP_HI;
    float n = nearbyintf(x * LOG2E);
    float r = fmaf(n, LN2_HI, x);
    r = fmaf(n, LN2_LO, r);
    float p = EXP_C0;
    p = fmaf(p, r, EXP_C1);
    p = fmaf(p, r, EXP_C2);
    p = fmaf(p, r, EXP_C3);
    p = fmaf(p, r, EXP_C4);
    p = fmaf(p, r, EXP_C5);
    p = fmaf(p, r * r, r + 1.0f);
    uint32_t bits = (uint32_t)((int)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

void exp_inplace_ref(float *v, int count) {
    for (int i = 0; i < count; i++) v[i] = exp_ref(v[i]);
}

/* A sum in a fixed order (the values in logical order): 16 running lanes, then the lanes pairwise. */
float sum_in_order(const float *v, int count) {
    float lanes[16] = {0};
    int i = 0;
    for (; i + 16 <= count; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += v[i + j];
    for (int j = 0; i < count; i++, j++) lanes[j] += v[i];
    for (int width = 8; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    return lanes[0];
}

/* x / rms(x) * w over one row (float32). */
static void rms_norm_ref(const float *x, const float *w, float eps, int n, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss = fmaf(x[i], x[i], ss);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* The position of new row j of a view (a tree node's own, from the segment's positions). */
static inline int64_t new_position(const attention_view *a, int j) { return a->positions ? a->positions[j] : a->start + j; }

int visible_slots(const attention_view *a, int row, int *slots) {
    int count = 0;
    if (a->every_slot) { /* attends: [n, start + n] over every slot (the draft head's token trees; no window) */
        for (int s = 0; s < a->start + a->n; s++)
            if (a->attends[(size_t)row * (a->start + a->n) + s]) slots[count++] = s;
        return count;
    }
    /* a window shows the keys at positions > p - window: cached slot s holds position s */
    int64_t oldest = a->window > 0 ? new_position(a, row) - a->window + 1 : 0;
    int first = oldest <= 0 ? 0 : oldest >= a->start ? a->start : (int)oldest;
    for (int s = first; s < a->start; s++) slots[count++] = s;
    for (int j = 0; j <= row; j++)
        if ((a->attends == NULL || a->attends[(size_t)row * a->n + j]) && (a->window <= 0 || new_position(a, j) >= oldest))
            slots[count++] = a->start + j;
    return count;
}

void softcap_scores(float *scores, int count, float cap) {
    for (int l = 0; l < count; l++) {
        float x = scores[l] / cap;
        scores[l] = cap * tanh_from_exp(x, exp_ref(-2.0f * fabsf(x)));
    }
}

/* ---- float16 keys and values (engine.h: what is stored, and why no subnormal is) ---------------- */

uint16_t half_from_float(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN: quiet, payload's top bits */
    if (ax >= 0x477fe000u) return (uint16_t)(sign | 0x7bffu);                     /* clamped to 65504 (infinity too) */
    if (ax < 0x387fe000u) return (uint16_t)sign;     /* rounds to a subnormal or zero: signed zero */
    if (ax < 0x38800000u) return (uint16_t)(sign | 0x0400u); /* just below 2^-14: rounds up to it */
    uint32_t r = ax - 0x38000000u;                   /* the exponent rebiased (127 -> 15) */
    return (uint16_t)(sign | ((r + 0x0fffu + ((r >> 13) & 1u)) >> 13)); /* nearest, ties to even */
}

float float_from_half(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) { /* zero, or a subnormal (never stored; exact all the same) */
        float v = (float)m * 0x1p-24f;
        return sign ? -v : v;
    }
    x = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112u) << 23) | (m << 13);
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static void store_half_ref(const float *x, uint16_t *out, int n) {
    for (int i = 0; i < n; i++) out[i] = half_from_float(x[i]);
}

/* Element i of a float32 or float16 row. */
static inline float kv_element(const void *row, int half, int i) {
    return half ? float_from_half(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* One query head's attention over its visible keys ``slots`` [count], in logical order: scores
 * (scaled, soft-capped where the view says), their softmax, the weighted sum of values (``scores``
 * [count] is the caller's scratch). */
static void attend_head_ref(const attention_view *a, const float *q, float *out, int head, float *scores, const int *slots,
                            int count) {
    int D = a->head_dim, g = head / (a->heads / a->kv_heads);
    q += (size_t)head * D;
    size_t width = a->half ? 2 : 4;
    const char *K = (const char *)a->keys + (size_t)g * a->cap * D * width, *V = (const char *)a->values + (size_t)g * a->cap * D * width;
    float scale = a->scale, best = -INFINITY;
    for (int l = 0; l < count; l++) {
        const void *k = K + (size_t)slots[l] * D * width;
        float s = 0.0f;
        for (int i = 0; i < D; i++) s = fmaf(q[i], kv_element(k, a->half, i), s);
        scores[l] = s * scale;
    }
    if (a->softcap > 0.0f) softcap_scores(scores, count, a->softcap);
    for (int l = 0; l < count; l++)
        if (scores[l] > best) best = scores[l];
    for (int l = 0; l < count; l++) scores[l] -= best;
    exp_inplace_ref(scores, count);
    float total = sum_in_order(scores, count);
    out += (size_t)head * D;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int l = 0; l < count; l++) {
        const void *v = V + (size_t)slots[l] * D * width;
        float p = scores[l];
        for (int i = 0; i < D; i++) out[i] = fmaf(p, kv_element(v, a->half, i), out[i]);
    }
    float inv = 1.0f / total;
    for (int i = 0; i < D; i++) out[i] *= inv;
}

int attend_ref(const attention_view *a, const float *q, float *out, int head0, int group, float *scores, const int *slots,
               int count) {
    for (int h = head0; h < head0 + group; h++) attend_head_ref(a, q, out, h, scores, slots, count);
    return 1;
}

void install_portable(kernel_set *k) {
    for (int layout = 0; layout < LAYOUTS; layout++)
        for (int kind = 0; kind < KINDS; kind++) k->tile[layout][kind] = (tile_kernel){tile_ref, REF_ROWS, ISA_PORTABLE};
    k->prepare_f32 = prepare_f32_ref;
    k->prepare_bf16 = prepare_bf16_ref;
    k->prepare_int8 = prepare_int8_ref;
    k->exp_inplace = exp_inplace_ref;
    k->rms_norm = rms_norm_ref;
    k->attend = attend_ref;
    k->store_half = store_half_ref;
    k->first_max = keyed_first_max_plain; /* both keyed_scan.h's */
    k->keyed_max = keyed_stretch_plain;
    k->attend_rows = NULL; /* each row alone (layer.c) */
    for (int op = 0; op < OPS; op++) k->isa[op] = ISA_PORTABLE;
}
