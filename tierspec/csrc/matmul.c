/* Products out (+)= x W^T: the rows prepared once for the weight's layout, then the weight's tiles
 * shared among threads, each tile computed whole by one thread over every row of the pass, in
 * groups of the kernel's row count (the order of each output's sums is the kernel's, whatever the
 * group: a row's result does not depend on the other rows). A weight stacked from parts of
 * different kinds (blocks.h) runs each part's kernel on the same prepared rows, into its own
 * columns of out. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

/* Products over this many rows or fewer run on one thread where a weight has no measured setting
 * (packed_weight.one_thread_rows; costs.few_row_threads measures it per model and machine, as the
 * ISA does not decide it): on a Zen 5 (the AVX-512 paths) whole passes of 1 / 2 rows took 3.0 / 3.8
 * ms on one thread, 3.6 / 4.0 on two; on a 2-core AMD EPYC Zen 3 VM (AVX2) one thread streamed a 70
 * MB Q4_1 weight's one-row int8 product at 12 GB/s, two at 22 GB/s (one-row passes 10.5 against 7.5
 * ms, min of 40); on a 2-core Zen 4 VM (AVX-512 VNNI) one-row passes took 5.6-6.9 ms with one-thread
 * products, 5.1-5.9 with two (medians of 40 in nine processes each, alternating). */
int one_thread_rows(const packed_weight *w) {
    return w->one_thread_rows_set ? w->one_thread_rows : cpu.level >= ISA_AVX512 ? 2 : 0;
}

/* A chunk's largest output in one row (``linear_maxima``): the first column holding it (-1 for a chunk
 * with no columns); ``nan`` where the row holds a NaN in the chunk's columns. */
typedef struct {
    float value;
    int32_t nan;
    int64_t column;
} row_top;

typedef struct {
    matmul_args a[MAX_PARTS];
    tile_kernel kernel[MAX_PARTS];
    int first_chunk[MAX_PARTS + 1]; /* part p's pieces are chunks first_chunk[p] .. first_chunk[p + 1] - 1 */
    int column0[MAX_PARTS];         /* part p's first output column */
    int parts;
    int tiles_per_chunk;
    row_top *tops; /* [chunks, M] or NULL: each chunk's largest output per row */
    const row_draws *draws; /* or NULL: no keyed row */
    row_top *drawn;         /* [chunks, M] with draws: each chunk's perturbed maximum per keyed row (nan: its status) */
} matmul_task_args;

static _Thread_local scratch_t scratch_scaled;

/* The chunk's perturbed maximum of each keyed row (``linear_draws``), its outputs still in this core's cache. */
static void draw_chunk(const matmul_task_args *task, const matmul_args *a, int p, int c0, int c1, row_top *drawn) {
    const row_draws *d = task->draws;
    for (int m = 0; m < a->M; m++) {
        if (!d->keyed[m]) continue;
        const float *x = a->out + (size_t)m * a->ldo + c0;
        float temperature = d->temperature[m];
        if (temperature != 1.0f) { /* x / t, as torch divides a float32 row by the temperature */
            float *scaled = (float *)scratch_get(&scratch_scaled, (size_t)(c1 - c0) * sizeof(float));
            for (int i = 0; i < c1 - c0; i++) scaled[i] = x[i] / temperature;
            x = scaled;
        }
        float value = 0.0f;
        int64_t token = -1;
        int status = kernels.keyed_max(x, c1 - c0, task->column0[p] + c0, d->keys[m], &value, &token);
        drawn[m] = status == KEYED_FOUND ? (row_top){value, KEYED_FOUND, token} : (row_top){0.0f, status, -1};
    }
}

static void matmul_task(void *raw, int chunk) {
    const matmul_task_args *task = (const matmul_task_args *)raw;
    int p = 0;
    while (chunk >= task->first_chunk[p + 1]) p++;
    const matmul_args *a = &task->a[p];
    int tiles = (a->w->N + TILE - 1) / TILE;
    int t0 = (chunk - task->first_chunk[p]) * task->tiles_per_chunk;
    int t1 = t0 + task->tiles_per_chunk < tiles ? t0 + task->tiles_per_chunk : tiles;
    const tile_kernel *k = &task->kernel[p];
    /* AMX's tile configuration (ldtilecfg, ~66 ns on a Xeon) only where the tile kernel runs: not for
     * a pass whose every row group takes the few-row kernel (a one-row pass's thousands of products) */
    const int tiles_run = a->M >= k->few_below;
    if (k->enter && tiles_run) k->enter();
    for (int t = t0; t < t1; t++)
        for (int m0 = 0; m0 < a->M; m0 += k->rows) {
            int mt = a->M - m0 < k->rows ? a->M - m0 : k->rows;
            if (mt < k->few_below)
                for (int r = 0; r < mt; r += k->few_rows) k->few(a, t, m0 + r, mt - r < k->few_rows ? mt - r : k->few_rows);
            else k->run(a, t, m0, mt);
        }
    if (k->leave && tiles_run) k->leave();
    if (task->tops && t0 < t1) {
        /* the chunk's outputs of each row (a few KB, still in this core's cache): their first maximum */
        int c0 = t0 * TILE, c1 = t1 * TILE < a->w->N ? t1 * TILE : a->w->N;
        row_top *tops = task->tops + (size_t)chunk * a->M;
        for (int m = 0; m < a->M; m++) {
            float top = 0.0f;
            int64_t at = kernels.first_max(a->out + (size_t)m * a->ldo + c0, c1 - c0, &top);
            tops[m] = at < 0 ? (row_top){0.0f, 1, -1} : (row_top){top, 0, task->column0[p] + c0 + at};
        }
    }
    if (task->draws && t0 < t1) {
        int c0 = t0 * TILE, c1 = t1 * TILE < a->w->N ? t1 * TILE : a->w->N;
        draw_chunk(task, a, p, c0, c1, task->drawn + (size_t)chunk * a->M);
    }
}

static _Thread_local scratch_t scratch_rows;

/* [chunks, M] answers of the chunks (none yet: column -1). */
static row_top *chunk_answers(int chunks, int M, const char *what) {
    row_top *answers = malloc((size_t)chunks * M * sizeof(row_top));
    if (!answers) { /* no Python error can be raised here (the GIL is released): say it and stop */
        fprintf(stderr, "tierspec pass engine: out of memory for %d rows' %s\n", M, what);
        abort();
    }
    for (size_t i = 0; i < (size_t)chunks * M; i++) answers[i] = (row_top){0.0f, 0, -1};
    return answers;
}

static int row_bytes(int layout) { return layout == LAYOUT_BF16 ? 2 : layout == LAYOUT_INT8 ? 1 : 4; }

/* The sums of the 8-bit rows per 16 values (Q6_K's halves of a block), exact integers. */
static void half_block_sums(const int8_t *xq, int M, int K, int32_t *out) {
    for (int m = 0; m < M; m++)
        for (int h = 0; h < K / 16; h++) {
            int32_t total = 0;
            for (int i = 0; i < 16; i++) total += xq[(size_t)m * K + 16 * h + i];
            out[(size_t)m * (K / 16) + h] = total;
        }
}

/* Rows from which a product's rows are rounded to 8 bits (or widened) by every thread, each a share of
 * the rows; each row's bytes are its own whatever the split. On a Xeon with AMX (2 threads) a 576 x 1,536
 * product over 256 rows spent ~120 of its ~590 us preparing them on one thread; shared from 64 rows,
 * cached passes of 96 / 128 rows ran 3-7% faster and of 64 rows level (fewer rows: not measured). */
#define PREPARE_SHARED_ROWS 64

typedef struct {
    const packed_weight *w;
    const float *x;
    int M;
    char *mem;          /* the rows as the kernels read them */
    float *sums;        /* per row and block: the scale (8-bit rows) or the sum */
    int32_t *isums;     /* 8-bit rows: per row and block, the sum of the 8-bit values */
    float *offsets;     /* 8-bit rows: per row and block, scale * isum (the minimum's factor) */
    int32_t *half_isums; /* Q6_K's 8-bit rows: per row and half block; NULL elsewhere */
    int rows_per_chunk;
} prepare_task_args;

static void prepare_task(void *raw, int chunk) {
    const prepare_task_args *t = (const prepare_task_args *)raw;
    const packed_weight *w = t->w;
    int K = w->K, KB = K / QK, m0 = chunk * t->rows_per_chunk;
    int rows = t->M - m0 < t->rows_per_chunk ? t->M - m0 : t->rows_per_chunk;
    if (rows <= 0) return;
    const float *x = t->x + (size_t)m0 * K;
    char *mem = t->mem + (size_t)m0 * K * row_bytes(w->layout);
    float *sums = t->sums + (size_t)m0 * KB;
    if (w->layout == LAYOUT_INT8) {
        int32_t *isums = t->isums + (size_t)m0 * KB;
        kernels.prepare_int8(x, rows, K, (int8_t *)mem, sums, isums);
        /* the minimum's factor of each row's block, as every 8-bit kernel took it a tile at a time: the same float */
        float *offsets = t->offsets + (size_t)m0 * KB;
        for (size_t i = 0; i < (size_t)rows * KB; i++) offsets[i] = sums[i] * (float)isums[i];
    }
    else if (w->layout == LAYOUT_BF16) kernels.prepare_bf16(x, rows, K, (uint16_t *)mem, sums);
    else kernels.prepare_f32(w->round_rows, x, rows, K, (float *)mem, sums);
    if (t->half_isums) half_block_sums((const int8_t *)mem, rows, K, t->half_isums + (size_t)m0 * (K / 16));
}

/* ``linear_maxima`` and ``linear_draws``: the product, each row's first maximum (maxima) and each keyed
 * row's draw (draws, tokens), found chunk by chunk on the threads and joined here. */
static void linear_scored(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int nth,
                          int64_t *maxima, const row_draws *draws, int64_t *tokens) {
    int64_t started = profiling ? now_ns() : 0;
    int KB = w->K / QK;
    const packed_weight *single[1] = {w};
    const packed_weight *const *parts = w->parts ? w->part : single;
    int count = w->parts ? w->parts : 1, halves = 0;
    for (int p = 0; p < count; p++) halves |= parts[p]->kind == KIND_Q6K && w->layout == LAYOUT_INT8;
    /* the rows padded to a multiple of 16 (zeros): the tile kernels read x 16 rows at a time */
    int padded = (M + 15) / 16 * 16;
    size_t rows_bytes = ((size_t)padded * w->K * row_bytes(w->layout) + 63) & ~(size_t)63;
    size_t sums_bytes = ((size_t)M * KB * 4 + 63) & ~(size_t)63;
    size_t halves_bytes = halves ? ((size_t)M * KB * 8 + 63) & ~(size_t)63 : 0;
    char *mem = scratch_get(&scratch_rows, rows_bytes + 3 * sums_bytes + halves_bytes);
    float *sums = (float *)(mem + rows_bytes);
    int32_t *isums = (int32_t *)(mem + rows_bytes + sums_bytes);
    float *offsets = (float *)(mem + rows_bytes + 2 * sums_bytes);
    int32_t *half_isums = halves ? (int32_t *)(mem + rows_bytes + 3 * sums_bytes) : NULL;
    /* a small product is not worth waking the other threads for */
    if ((int64_t)w->N * w->K * (M < 4 ? M : 4) < 65536 || M <= one_thread_rows(w)) nth = 1;
    /* the rows as the kernels read them, row by row: shared among the threads from PREPARE_SHARED_ROWS rows */
    int prepare_chunks = M >= PREPARE_SHARED_ROWS && nth > 1 ? nth : 1;
    prepare_task_args prepare = {w, x, M, mem, sums, isums, offsets, half_isums, (M + prepare_chunks - 1) / prepare_chunks};
    run_parallel(prepare_task, &prepare, prepare_chunks, nth);
    memset(mem + (size_t)M * w->K * row_bytes(w->layout), 0, (size_t)(padded - M) * w->K * row_bytes(w->layout));
    int tiles = (w->N + TILE - 1) / TILE;
    /* pieces small enough to balance threads, large enough that claiming them costs nothing */
    int per = tiles / (8 * (nth > 0 ? nth : 1));
    if (per < 1) per = 1;
    matmul_task_args task;
    task.parts = count;
    task.tiles_per_chunk = per;
    task.first_chunk[0] = 0;
    for (int p = 0; p < count; p++) {
        const packed_weight *part = parts[p];
        int row0 = w->parts ? w->part_row0[p] : 0;
        task.a[p] = (matmul_args){part, mem, sums, isums, half_isums, offsets, M, out + row0, ldo, accumulate};
        task.kernel[p] = kernels.tile[w->layout][part->kind];
        task.column0[p] = row0;
        task.first_chunk[p + 1] = task.first_chunk[p] + ((part->N + TILE - 1) / TILE + per - 1) / per;
    }
    int chunks = task.first_chunk[count];
    task.tops = maxima ? chunk_answers(chunks, M, "maxima") : NULL;
    task.draws = draws;
    task.drawn = draws ? chunk_answers(chunks, M, "draws") : NULL;
    run_parallel(matmul_task, &task, chunks, nth);
    if (maxima) {
        /* Each row's first maximum over every chunk's (a larger value, or an equal one in an earlier
         * column, wins: the chunks may come in any order); -1 for a row holding a NaN. */
        for (int m = 0; m < M; m++) {
            row_top best = {0.0f, 0, -1};
            for (int c = 0; c < chunks; c++) {
                const row_top *r = &task.tops[(size_t)c * M + m];
                best.nan |= r->nan;
                if (r->column >= 0 && (best.column < 0 || r->value > best.value ||
                                       (r->value == best.value && r->column < best.column)))
                    best = (row_top){r->value, best.nan, r->column};
            }
            maxima[m] = best.nan ? -1 : best.column;
        }
        free(task.tops);
    }
    if (draws) {
        /* Each keyed row's perturbed maximum over every chunk's, as the maxima are joined: -1 where a chunk
         * saw a NaN, -2 where one left the row to the extension (or the row is not keyed). */
        for (int m = 0; m < M; m++) {
            row_top best = {0.0f, KEYED_FOUND, -1};
            int nan = 0, elsewhere = !draws->keyed[m];
            for (int c = 0; c < chunks && !elsewhere; c++) {
                const row_top *r = &task.drawn[(size_t)c * M + m];
                nan |= r->nan == KEYED_NAN;
                elsewhere |= r->nan == KEYED_ELSEWHERE;
                if (r->column >= 0 && (best.column < 0 || r->value > best.value ||
                                       (r->value == best.value && r->column < best.column)))
                    best = *r;
            }
            tokens[m] = nan ? -1 : elsewhere || best.column < 0 ? -2 : best.column;
        }
        free(task.drawn);
    }
    if (profiling) profile_ns[1] += now_ns() - started;
}

void linear_maxima(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int nth,
                   int64_t *maxima) {
    linear_scored(w, x, M, out, ldo, accumulate, nth, maxima, NULL, NULL);
}

void linear_draws(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int nth,
                  int64_t *maxima, const row_draws *draws, int64_t *tokens) {
    linear_scored(w, x, M, out, ldo, accumulate, nth, maxima, draws, tokens);
}

void linear(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int nth) {
    linear_maxima(w, x, M, out, ldo, accumulate, nth, NULL);
}
