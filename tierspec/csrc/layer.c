/* A decoder layer fused into one computation (norms, the q/k/v bias and per-head norms, rotary, KV
 * write, attention, the gated MLP, the units' output norms, residuals) over a pass's rows, and the
 * pass over a range of layers. engine.h's layer_desc lists what each architecture adds to Llama's
 * layer, in the order computed here (tierspec/llama.py's ArchAttention and ArchDecoderLayer compute
 * the same with torch's operators).
 *
 * One runner serves solo and batched passes: a pass is a list of segments (each one sequence's new
 * rows with its own cache), a solo pass a list of one. The products run over every row of the pass
 * at once; each row's keys/values go to its own sequence's cache and its attention reads only that
 * cache, so a row's results are what its sequence's own pass gives. Everything between the products
 * is computed row by row, so a row's results never depend on the others.
 *
 * Long passes (a prompt's prefill) run in chunks of ``kernels.pass_rows`` rows through all the layers, one chunk
 * after the other: a row's attention needs the keys of the rows before it, which an earlier chunk
 * (or its own) has written by then, so a chunked pass gives exactly the unchunked pass's numbers
 * (the products are row-independent). Why chunks: the activations of a chunk stay in the caches
 * between one product and the next, and the scratch memory stays bounded whatever the prompt. */
#include <math.h>
#include <string.h>

#include "engine.h"

static _Thread_local scratch_t scratch_main, scratch_scores;

/* ---- attention ------------------------------------------------------------------------------- */

typedef struct {
    const pass_desc *p;
    const layer_desc *L;
    int layer;         /* the stack's index of L (its column of the segments' KV tables) */
    int c0;            /* the chunk's first row */
    const float *q;    /* [chunk rows, heads * D] */
    float *out;        /* [chunk rows, heads * D] */
    const int *blocks; /* per block of rows: its first row in the chunk, its rows (all of one segment), whether they
                        * go to attend_rows */
    const int *tasks;  /* per task: its block, first query head and query heads (all of one kv head) */
} attention_task_args;

/* Query rows a task of a chain's rows takes at most (their keys and values widened once for all:
 * kernel_set.attend_rows). */
#define ATTENTION_BLOCK_ROWS 8

static attention_view segment_view(const layer_desc *L, int layer, const segment_desc *sg) {
    const int64_t *kv = sg->kv + KV_COLUMNS * (size_t)layer;
    attention_view v = {L->heads, L->kv_heads, L->head_dim, (const void *)(intptr_t)kv[0], (const void *)(intptr_t)kv[1],
                        kv[3] == KV_HALF, (int)kv[2], sg->start, sg->n, sg->attends, sg->every_slot && sg->attends != NULL,
                        L->window, sg->positions, L->attention_scale, L->softcap};
    return v;
}

/* Whether new row j of ``sg`` sees exactly slots 0 .. start + j in a layer of window ``window``: a
 * chain (no mask) whose window, if any, cuts none of them (visible_slots reads the positions only
 * for a window). */
static int sees_a_chain(const segment_desc *sg, int j, int window) {
    return sg->attends == NULL && (window <= 0 || (sg->positions ? sg->positions[j] : sg->start + j) + 1 <= window);
}

/* One row's heads head0 .. head0 + group - 1, alone. */
static void attend_row(const attention_task_args *t, const attention_view *view, const segment_desc *sg, int local,
                       int head0, int group) {
    int heads = t->L->heads, D = t->L->head_dim, row = t->c0 + local, keys = view->start + view->n;
    char *mem = scratch_get(&scratch_scores, (size_t)keys * 4 * (group + 1) + 64);
    float *scores = (float *)mem;
    int *slots = (int *)(mem + (size_t)keys * 4 * group);
    int count = visible_slots(view, row - sg->row0, slots);
    const float *q = t->q + (size_t)local * heads * D;
    float *out = t->out + (size_t)local * heads * D;
    if (!kernels.attend(view, q, out, head0, group, scores, slots, count))
        attend_ref(view, q, out, head0, group, scores, slots, count);
}

static void attention_task(void *raw, int chunk) { /* chunk: one task (a block of rows, a group of query heads) */
    const attention_task_args *t = (const attention_task_args *)raw;
    const layer_desc *L = t->L;
    const int *task = t->tasks + 3 * chunk;
    int heads = L->heads, D = L->head_dim, block = task[0], head0 = task[1], group = task[2];
    int local = t->blocks[3 * block], rows = t->blocks[3 * block + 1];
    const segment_desc *sg = &t->p->segments[t->p->segment_of[t->c0 + local]];
    attention_view view = segment_view(L, t->layer, sg);
    if (t->blocks[3 * block + 2] && (rows > 1 || group > 1)) { /* chain rows: keys and values widened once for all */
        int j0 = t->c0 + local - sg->row0;
        float *scratch = (float *)scratch_get(&scratch_scores, attend_rows_scratch(rows, group, sg->start + j0 + rows, D));
        if (kernels.attend_rows(&view, t->q + (size_t)local * heads * D, t->out + (size_t)local * heads * D, j0, rows,
                                head0, group, scratch))
            return;
    }
    for (int r = 0; r < rows; r++) attend_row(t, &view, sg, local + r, head0, group);
}

/* Whether ``tasks`` equal tasks leave some of ``threads`` threads idle while others work: fewer tasks than
 * threads, or (below two each) a count the threads do not divide — 3 tasks over 2 threads keep one idle a
 * third of the time; 2 or 4 do not. */
static int unbalanced(int tasks, int threads) {
    return threads > 1 && (tasks < threads || (tasks % threads != 0 && tasks < 2 * threads));
}

/* The chunk's rows in blocks for attention_task, into ``blocks`` [3 n] (first row in the chunk, rows,
 * whether they go to attend_rows): consecutive rows of one segment that see a chain, up to
 * ATTENTION_BLOCK_ROWS together where the path has attend_rows (a single such row too, where a task
 * takes several of its query heads: they then share each widened block of keys and values, where
 * attend widens them once a head); each other row alone. Then, while the tasks (a block's kv heads)
 * leave the threads unbalanced (``unbalanced``), the largest block is halved: a verify pass of a few rows of one sequence made one block of 3
 * tasks over 2 threads (one idle a third of the time) — two blocks balance them, and each still
 * widens the keys once for its rows (a row a task before: every row read the whole cache again).
 * The results are the same whatever the blocks (attend_rows gives each row what attend gives it).
 * Returns the number of blocks. */
static int attention_blocks(const pass_desc *p, const layer_desc *L, int c0, int n, int threads, int *blocks) {
    int count = 0;
    for (int r = 0; r < n;) {
        const segment_desc *sg = &p->segments[p->segment_of[c0 + r]];
        int rows = 1, chain = kernels.attend_rows != NULL && sees_a_chain(sg, c0 + r - sg->row0, L->window);
        if (chain)
            while (rows < ATTENTION_BLOCK_ROWS && r + rows < n && p->segment_of[c0 + r + rows] == p->segment_of[c0 + r] &&
                   sees_a_chain(sg, c0 + r + rows - sg->row0, L->window))
                rows++;
        blocks[3 * count] = r, blocks[3 * count + 1] = rows, blocks[3 * count + 2] = chain;
        count++;
        r += rows;
    }
    while (unbalanced(count * L->kv_heads, threads)) {
        int largest = 0;
        for (int b = 1; b < count; b++)
            if (blocks[3 * b + 1] > blocks[3 * largest + 1]) largest = b;
        int rows = blocks[3 * largest + 1], first = (rows + 1) / 2;
        if (rows < 2) break;
        blocks[3 * largest + 1] = first;
        blocks[3 * count] = blocks[3 * largest] + first, blocks[3 * count + 1] = rows - first;
        blocks[3 * count + 2] = blocks[3 * largest + 2];
        count++;
    }
    return count;
}

/* The attention tasks over the ``count`` blocks, into ``tasks`` [3 count heads] (block, first query head, query
 * heads; the threads claim them in this order). A task takes a kv head's whole group of query heads (the group
 * shares each load, each widened block, of its keys and values); then, while the tasks leave the threads
 * unbalanced, the largest group is halved: a one-row pass of the default model made 3 tasks over 2 threads, one thread
 * idle a third of the attention; 4 tasks (3, 3, 2 and 1 heads) keep both busy, one kv head's keys read twice.
 * Each head gets what it gets alone, whatever its task's group. Returns the number of tasks. */
static int attention_tasks(const layer_desc *L, int count, const int *blocks, int threads, int *tasks) {
    int per = L->heads / L->kv_heads, n = 0;
    for (int b = 0; b < count; b++)
        for (int g = 0; g < L->kv_heads; g++, n++) tasks[3 * n] = b, tasks[3 * n + 1] = g * per, tasks[3 * n + 2] = per;
    while (unbalanced(n, threads)) {
        int largest = -1;
        for (int i = 0; i < n; i++)
            if (tasks[3 * i + 2] > 1 && (largest < 0 || tasks[3 * i + 2] * blocks[3 * tasks[3 * i] + 1] >
                                                             tasks[3 * largest + 2] * blocks[3 * tasks[3 * largest] + 1]))
                largest = i;
        if (largest < 0) break;
        int group = tasks[3 * largest + 2], first = (group + 1) / 2;
        tasks[3 * largest + 2] = first;
        tasks[3 * n] = tasks[3 * largest], tasks[3 * n + 1] = tasks[3 * largest + 1] + first, tasks[3 * n + 2] = group - first;
        n++;
    }
    return n;
}

/* ---- the gated MLP's activation --------------------------------------------------------------- */

typedef struct {
    const float *gu; /* [n, 2I]: gate, then up */
    float *act;      /* [n, I] */
    int inter;
} gate_args;

static void swiglu_task(void *raw, int r) { /* one row: silu(g) * u = g / (1 + exp(-g)) * u */
    const gate_args *a = (const gate_args *)raw;
    const float *g = a->gu + (size_t)r * 2 * a->inter, *u = g + a->inter;
    float *o = a->act + (size_t)r * a->inter;
    for (int i = 0; i < a->inter; i++) o[i] = -g[i];
    kernels.exp_inplace(o, a->inter);
    for (int i = 0; i < a->inter; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
}

/* one row: gelu_tanh(g) * u = 0.5 g (1 + tanh(t)) * u with t = gelu_tanh_argument(g); tanh from the
 * path's exp of -2|t| (tanh_from_exp: the same bits on every path) */
static void gelu_tanh_task(void *raw, int r) {
    const gate_args *a = (const gate_args *)raw;
    const float *g = a->gu + (size_t)r * 2 * a->inter, *u = g + a->inter;
    float *o = a->act + (size_t)r * a->inter;
    for (int i = 0; i < a->inter; i++) o[i] = -2.0f * fabsf(gelu_tanh_argument(g[i]));
    kernels.exp_inplace(o, a->inter);
    for (int i = 0; i < a->inter; i++) o[i] = 0.5f * g[i] * (1.0f + tanh_from_exp(gelu_tanh_argument(g[i]), o[i])) * u[i];
}

void activate_rows(int activation, const float *gate_up, int rows, int inter, float *out, int threads) {
    gate_args ga = {gate_up, out, inter};
    run_parallel(activation == ACT_GELU_TANH ? gelu_tanh_task : swiglu_task, &ga, rows, threads);
}

/* ---- a unit's output ----------------------------------------------------------------------------- */

/* h += x W^T for the chunk's n rows, or, with an output norm (Gemma's post-norms), h += rms_norm(x
 * W^T) * norm: the product then goes to ``scratch`` [n, H] first. */
static void add_unit_output(const layer_desc *L, const packed_weight *w, const float *x, int n, const float *norm,
                            float *scratch, float *h, int threads) {
    int H = L->hidden;
    if (!norm) {
        linear(w, x, n, h, H, 1, threads);
        return;
    }
    linear(w, x, n, scratch, H, 0, threads);
    for (int r = 0; r < n; r++) {
        float *y = scratch + (size_t)r * H, *hr = h + (size_t)r * H;
        kernels.rms_norm(y, norm, L->eps, H, y);
        for (int i = 0; i < H; i++) hr[i] += y[i];
    }
}

/* ---- q and k before attention -------------------------------------------------------------------- */

/* One row's q/k/v [(heads + 2 kv_heads) D] in place: the bias, each q and k head's norm, the
 * rotation of each q and k head's first rotary_dims by the row's factors ``c``, ``s`` [rotary_dims]. */
static void prepare_qkv_row(const layer_desc *L, float *x, const float *c, const float *s) {
    int D = L->head_dim, heads = L->heads, kvh = L->kv_heads, R = L->rotary_dims, half = R / 2;
    if (L->qkv_bias)
        for (int i = 0; i < (heads + 2 * kvh) * D; i++) x[i] += L->qkv_bias[i];
    if (L->q_norm)
        for (int hh = 0; hh < heads; hh++) kernels.rms_norm(x + (size_t)hh * D, L->q_norm, L->eps, D, x + (size_t)hh * D);
    if (L->k_norm)
        for (int g = 0; g < kvh; g++) kernels.rms_norm(x + (size_t)(heads + g) * D, L->k_norm, L->eps, D, x + (size_t)(heads + g) * D);
    float tmp[512];
    for (int hh = 0; hh < heads + kvh; hh++) { /* q heads and k heads rotate; v does not */
        float *v = x + (size_t)hh * D;
        for (int i = 0; i < R; i++) tmp[i] = v[i] * c[i] + v[(i + half) % R] * s[i];
        memcpy(v, tmp, (size_t)R * 4);
    }
}

/* ---- one layer over a chunk of rows ---------------------------------------------------------- */

/* Layer ``layer`` of the pass over rows c0 .. c1 - 1 of h (in place): h += attention unit (if
 * flags & UNIT_ATTENTION), then h += MLP unit (if flags & UNIT_MLP); a unit's norms (before it and,
 * where the layer has one, on its output) run with it. */
static void run_layer_rows(const pass_desc *p, int layer, int c0, int c1, float *h) {
    const layer_desc *L = p->layers[layer];
    int flags = p->flags[layer], nth = p->threads, n = c1 - c0;
    int H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter;
    int qkv_width = (heads + 2 * kvh) * D;
    size_t need = (size_t)n * (H + qkv_width + 2 * heads * D + 2 * I + I + 3 + 3 * heads) * 4 + 7 * 64; /* + the blocks' and tasks' ints */
    char *mem = scratch_get(&scratch_main, need);
    float *xn = (float *)mem; /* [n, H]: a unit's normalised input, then (post-norms) its output */
    float *qkv = xn + (size_t)n * H;
    float *att = qkv + (size_t)n * qkv_width;
    float *q = att + (size_t)n * heads * D; /* the queries packed [n, heads * D] */
    float *gu = q + (size_t)n * heads * D;
    float *act = gu + (size_t)n * 2 * I;
    if (flags & UNIT_ATTENTION) {
        for (int r = 0; r < n; r++) kernels.rms_norm(h + (size_t)r * H, L->norm_in, L->eps, H, xn + (size_t)r * H);
        linear(L->qkv, xn, n, qkv, qkv_width, 0, nth);
        const rotary_table *table = &p->rotary[L->rotary_table];
        int64_t work = 0;
        for (int r = 0; r < n; r++) {
            int row = c0 + r;
            const segment_desc *sg = &p->segments[p->segment_of[row]];
            const int64_t *kv = sg->kv + KV_COLUMNS * (size_t)layer;
            int cap = (int)kv[2], slot = sg->start + (row - sg->row0);
            float *x = qkv + (size_t)r * qkv_width;
            prepare_qkv_row(L, x, table->cos + (size_t)row * p->rotary_dims, table->sin + (size_t)row * p->rotary_dims);
            for (int g = 0; g < kvh; g++) {
                size_t at = (size_t)g * cap + slot;
                const float *k = x + (size_t)(heads + g) * D, *v = x + (size_t)(heads + kvh + g) * D;
                if (kv[3] == KV_HALF) { /* rounded once, here: every path reads the same bits */
                    kernels.store_half(k, (uint16_t *)(intptr_t)kv[0] + at * D, D);
                    kernels.store_half(v, (uint16_t *)(intptr_t)kv[1] + at * D, D);
                } else {
                    memcpy((float *)(intptr_t)kv[0] + at * D, k, (size_t)D * 4);
                    memcpy((float *)(intptr_t)kv[1] + at * D, v, (size_t)D * 4);
                }
            }
            work += (int64_t)heads * (L->window > 0 && L->window < slot + 1 ? L->window : slot + 1);
        }
        /* the queries packed (they were in gu, the MLP's: a model whose heads are wider than its MLP's
         * 3 I values a row wrote past the scratch's end) */
        for (int r = 0; r < n; r++) memcpy(q + (size_t)r * heads * D, qkv + (size_t)r * qkv_width, (size_t)heads * D * 4);
        int threads = work < 1024 ? 1 : nth; /* a few microseconds: one thread */
        int *blocks = (int *)(act + (size_t)n * I), *tasks = blocks + 3 * n; /* act's tail: 3 n + 3 n heads ints */
        int count = attention_blocks(p, L, c0, n, threads, blocks);
        int task_count = attention_tasks(L, count, blocks, threads, tasks);
        attention_task_args aa = {p, L, layer, c0, q, att, blocks, tasks};
        int64_t attention_started = profiling ? now_ns() : 0;
        if (profiling) {
            for (int b = 0; b < count; b++) profile_ns[4] += blocks[3 * b + 2] ? blocks[3 * b + 1] : 0;
            profile_ns[5] += task_count;
        }
        run_parallel(attention_task, &aa, task_count, threads);
        if (profiling) profile_ns[2] += now_ns() - attention_started;
        add_unit_output(L, L->o, att, n, L->attention_out_norm, xn, h, nth);
    }
    if (flags & UNIT_MLP) {
        for (int r = 0; r < n; r++) kernels.rms_norm(h + (size_t)r * H, L->norm_post, L->eps, H, xn + (size_t)r * H);
        linear(L->gate_up, xn, n, gu, 2 * I, 0, nth);
        activate_rows(L->activation, gu, n, I, act, n >= 8 ? nth : 1);
        add_unit_output(L, L->down, act, n, L->mlp_out_norm, xn, h, nth);
    }
}

void run_pass(const pass_desc *p) {
    int H = p->layers[p->first < p->last ? p->first : 0]->hidden;
    /* a mask over every slot may let a row see a later new row: such a pass (the draft head's few
     * rows) is never split */
    int chunk = kernels.pass_rows;
    for (int i = 0; i < p->count; i++)
        if (p->segments[i].every_slot && p->segments[i].attends) chunk = p->rows;
    for (int c0 = 0; c0 < p->rows; c0 += chunk) {
        int c1 = c0 + chunk < p->rows ? c0 + chunk : p->rows;
        float *h = p->h_out + (size_t)c0 * H;
        if (p->h_out != p->h_in) memcpy(h, p->h_in + (size_t)c0 * H, (size_t)(c1 - c0) * H * 4);
        for (int l = p->first; l < p->last; l++) {
            if (p->flags[l]) run_layer_rows(p, l, c0, c1, h);
            if (p->captures && p->captures[l]) memcpy(p->captures[l] + (size_t)c0 * H, h, (size_t)(c1 - c0) * H * 4);
        }
    }
}
