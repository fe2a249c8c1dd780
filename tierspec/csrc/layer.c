/* The Llama decoder layer fused into one computation (norms, rotary, KV write, attention, SwiGLU,
 * residuals) over a pass's rows, and the pass over a range of layers.
 *
 * One runner serves solo and batched passes: a pass is a list of segments (each one sequence's new
 * rows with its own cache), a solo pass a list of one. The products run over every row of the pass
 * at once; each row's keys/values go to its own sequence's cache and its attention reads only that
 * cache, so a row's results are what its sequence's own pass gives.
 *
 * Long passes (a prompt's prefill) run in chunks of PASS_ROWS rows through all the layers, one chunk
 * after the other: a row's attention needs the keys of the rows before it, which an earlier chunk
 * (or its own) has written by then, so a chunked pass gives exactly the unchunked pass's numbers
 * (the products are row-independent). Why chunks: the activations of a chunk stay in the caches
 * between one product and the next, and the scratch memory stays bounded whatever the prompt. */
#include <math.h>
#include <string.h>

#include "engine.h"

/* Rows per chunk of a long pass: measured on the default model (benchmarks/prefill.py). */
#define PASS_ROWS 64

static _Thread_local scratch_t scratch_main, scratch_scores;

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct {
    const pass_desc *p;
    const layer_desc *L;
    int layer;       /* the stack's index of L (its column of the segments' KV tables) */
    int c0;          /* the chunk's first row */
    const float *q;  /* [chunk rows, heads * D] */
    float *out;      /* [chunk rows, heads * D] */
    int group;       /* query heads per task, all of one kv head */
} attention_task_args;

static attention_view segment_view(const layer_desc *L, int layer, const segment_desc *sg) {
    const int64_t *kv = sg->kv + 3 * (size_t)layer;
    attention_view v = {L->heads, L->kv_heads, L->head_dim, (const float *)(intptr_t)kv[0], (const float *)(intptr_t)kv[1],
                        (int)kv[2], sg->start, sg->n, sg->attends, sg->every_slot && sg->attends != NULL};
    return v;
}

static void attention_task(void *raw, int chunk) { /* chunk: one (row, group of query heads) of the pass's chunk */
    const attention_task_args *t = (const attention_task_args *)raw;
    const layer_desc *L = t->L;
    int heads = L->heads, D = L->head_dim, groups = heads / t->group, local = chunk / groups, row = t->c0 + local;
    int head0 = chunk % groups * t->group;
    const segment_desc *sg = &t->p->segments[t->p->segment_of[row]];
    attention_view view = segment_view(L, t->layer, sg);
    int keys = view.start + view.n;
    char *mem = scratch_get(&scratch_scores, (size_t)keys * 4 * (t->group + 1) + 64);
    float *scores = (float *)mem;
    int *slots = (int *)(mem + (size_t)keys * 4 * t->group);
    int count = visible_slots(&view, row - sg->row0, slots);
    const float *q = t->q + (size_t)local * heads * D;
    float *out = t->out + (size_t)local * heads * D;
    if (!kernels.attend(&view, q, out, head0, t->group, scores, slots, count))
        attend_ref(&view, q, out, head0, t->group, scores, slots, count);
}

/* ---- SwiGLU ---------------------------------------------------------------------------------- */

typedef struct {
    const float *gu; /* [n, 2I] */
    float *act;      /* [n, I] */
    int inter;
} swiglu_args;

static void swiglu_task(void *raw, int r) { /* one row: silu(g) * u = g / (1 + exp(-g)) * u */
    const swiglu_args *a = (const swiglu_args *)raw;
    const float *g = a->gu + (size_t)r * 2 * a->inter, *u = g + a->inter;
    float *o = a->act + (size_t)r * a->inter;
    for (int i = 0; i < a->inter; i++) o[i] = -g[i];
    kernels.exp_inplace(o, a->inter);
    for (int i = 0; i < a->inter; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
}

/* ---- one layer over a chunk of rows ---------------------------------------------------------- */

/* Layer ``layer`` of the pass over rows c0 .. c1 - 1 of h (in place): h += attention unit (if
 * flags & UNIT_ATTENTION), then h += MLP unit (if flags & UNIT_MLP). */
static void run_layer_rows(const pass_desc *p, int layer, int c0, int c1, float *h) {
    const layer_desc *L = p->layers[layer];
    int flags = p->flags[layer], nth = p->threads, n = c1 - c0;
    int H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter;
    int qkv_width = (heads + 2 * kvh) * D;
    size_t need = (size_t)n * (H + qkv_width + heads * D + 2 * I + I) * 4 + 5 * 64;
    char *mem = scratch_get(&scratch_main, need);
    float *xn = (float *)mem;
    float *qkv = xn + (size_t)n * H;
    float *att = qkv + (size_t)n * qkv_width;
    float *gu = att + (size_t)n * heads * D;
    float *act = gu + (size_t)n * 2 * I;
    if (flags & UNIT_ATTENTION) {
        for (int r = 0; r < n; r++) kernels.rms_norm(h + (size_t)r * H, L->norm_in, L->eps, H, xn + (size_t)r * H);
        linear(L->qkv, xn, n, qkv, qkv_width, 0, nth);
        int half = D / 2;
        int64_t work = 0;
        for (int r = 0; r < n; r++) {
            int row = c0 + r;
            const segment_desc *sg = &p->segments[p->segment_of[row]];
            const int64_t *kv = sg->kv + 3 * (size_t)layer;
            float *keys = (float *)(intptr_t)kv[0], *values = (float *)(intptr_t)kv[1];
            int cap = (int)kv[2], slot = sg->start + (row - sg->row0);
            float *x = qkv + (size_t)r * qkv_width;
            const float *c = p->cos + (size_t)row * D, *s = p->sin + (size_t)row * D;
            float tmp[512];
            for (int hh = 0; hh < heads + kvh; hh++) { /* q heads and k heads rotate; v does not */
                float *v = x + (size_t)hh * D;
                for (int i = 0; i < D; i++) tmp[i] = v[i] * c[i] + v[(i + half) % D] * s[i];
                memcpy(v, tmp, (size_t)D * 4);
            }
            for (int g = 0; g < kvh; g++) {
                memcpy(keys + ((size_t)g * cap + slot) * D, x + (size_t)(heads + g) * D, (size_t)D * 4);
                memcpy(values + ((size_t)g * cap + slot) * D, x + (size_t)(heads + kvh + g) * D, (size_t)D * 4);
            }
            work += (int64_t)heads * (slot + 1);
        }
        /* the queries packed [n, heads * D] (gu is free until the MLP) */
        float *q = gu;
        for (int r = 0; r < n; r++) memcpy(q + (size_t)r * heads * D, qkv + (size_t)r * qkv_width, (size_t)heads * D * 4);
        /* a task takes a kv head's whole group of query heads (their keys and values loaded once for
         * all of them) where that leaves pieces enough to share among the threads, else one head:
         * the same results either way */
        int threads = work < 1024 ? 1 : nth; /* a few microseconds: one thread */
        attention_task_args aa = {p, L, layer, c0, q, att, n * kvh >= 4 * threads ? heads / kvh : 1};
        int64_t attention_started = profiling ? now_ns() : 0;
        run_parallel(attention_task, &aa, n * heads / aa.group, threads);
        if (profiling) profile_ns[2] += now_ns() - attention_started;
        linear(L->o, att, n, h, H, 1, nth);
    }
    if (flags & UNIT_MLP) {
        for (int r = 0; r < n; r++) kernels.rms_norm(h + (size_t)r * H, L->norm_post, L->eps, H, xn + (size_t)r * H);
        linear(L->gate_up, xn, n, gu, 2 * I, 0, nth);
        swiglu_args sa = {gu, act, I};
        run_parallel(swiglu_task, &sa, n, n >= 8 ? nth : 1);
        linear(L->down, act, n, h, H, 1, nth);
    }
}

void run_pass(const pass_desc *p) {
    int H = p->layers[p->first < p->last ? p->first : 0]->hidden;
    /* a mask over every slot may let a row see a later new row: such a pass (the draft head's few
     * rows) is never split */
    int chunk = PASS_ROWS;
    for (int i = 0; i < p->count; i++)
        if (p->segments[i].every_slot && p->segments[i].attends) chunk = p->rows;
    for (int c0 = 0; c0 < p->rows; c0 += chunk) {
        int c1 = c0 + chunk < p->rows ? c0 + chunk : p->rows;
        float *h = p->h_out + (size_t)c0 * H;
        if (p->h_out != p->h_in) memcpy(h, p->h_in + (size_t)c0 * H, (size_t)(c1 - c0) * H * 4);
        for (int l = p->first; l < p->last; l++)
            if (p->flags[l]) run_layer_rows(p, l, c0, c1, h);
    }
}
