/* Products out (+)= x W^T: the rows prepared once for the weight's layout, then the weight's tiles
 * shared among threads, each tile computed whole by one thread over every row of the pass, in
 * groups of the kernel's row count (the order of each output's sums is the kernel's, whatever the
 * group: a row's result does not depend on the other rows). */
#include <string.h>

#include "engine.h"

/* Products over this many rows or fewer run on one thread where one thread with prefetching nearly
 * saturates the memory: on a Zen 5 (the AVX-512 paths) whole passes of 1 / 2 rows took 3.0 / 3.8 ms
 * on one thread, 3.6 / 4.0 on two. Not on the AVX2 path's machine (a 2-core AMD EPYC Zen 3 VM): one
 * thread streamed a 70 MB Q4_1 weight's one-row int8 product at 12 GB/s, two at 22 GB/s, and the
 * default model's one-row int8 passes took 10.5 ms with one-thread products, 7.5 ms with two (min of
 * 40). The thread count never changes a result. */
static int single_thread_rows(void) { return cpu.level >= ISA_AVX512 ? 2 : 0; }

typedef struct {
    matmul_args a;
    tile_kernel kernel;
    int tiles_per_chunk;
} matmul_task_args;

static void matmul_task(void *raw, int chunk) {
    const matmul_task_args *task = (const matmul_task_args *)raw;
    const matmul_args *a = &task->a;
    int tiles = (a->w->N + TILE - 1) / TILE;
    int t0 = chunk * task->tiles_per_chunk, t1 = t0 + task->tiles_per_chunk < tiles ? t0 + task->tiles_per_chunk : tiles;
    const tile_kernel *k = &task->kernel;
    if (k->enter) k->enter();
    for (int t = t0; t < t1; t++)
        for (int m0 = 0; m0 < a->M; m0 += k->rows) {
            int mt = a->M - m0 < k->rows ? a->M - m0 : k->rows;
            (mt < k->few_below ? k->few : k->run)(a, t, m0, mt);
        }
    if (k->leave) k->leave();
}

static _Thread_local scratch_t scratch_rows;

static int row_bytes(int layout) { return layout == LAYOUT_BF16 ? 2 : layout == LAYOUT_INT8 ? 1 : 4; }

void linear(const packed_weight *w, const float *x, int M, float *out, int ldo, int accumulate, int nth) {
    int64_t started = profiling ? now_ns() : 0;
    int KB = w->K / QK;
    /* the rows padded to a multiple of 16 (zeros): the tile kernels read x 16 rows at a time */
    int padded = (M + 15) / 16 * 16;
    size_t rows_bytes = ((size_t)padded * w->K * row_bytes(w->layout) + 63) & ~(size_t)63;
    size_t sums_bytes = ((size_t)M * KB * 4 + 63) & ~(size_t)63;
    char *mem = scratch_get(&scratch_rows, rows_bytes + 2 * sums_bytes);
    float *sums = (float *)(mem + rows_bytes);
    int32_t *isums = (int32_t *)(mem + rows_bytes + sums_bytes);
    if (w->layout == LAYOUT_INT8) kernels.prepare_int8(x, M, w->K, (int8_t *)mem, sums, isums);
    else if (w->layout == LAYOUT_BF16) kernels.prepare_bf16(x, M, w->K, (uint16_t *)mem, sums);
    else kernels.prepare_f32(w->round_rows, x, M, w->K, (float *)mem, sums);
    memset(mem + (size_t)M * w->K * row_bytes(w->layout), 0, (size_t)(padded - M) * w->K * row_bytes(w->layout));
    int tiles = (w->N + TILE - 1) / TILE;
    /* a small product is not worth waking the other threads for */
    if ((int64_t)w->N * w->K * (M < 4 ? M : 4) < 65536 || M <= single_thread_rows()) nth = 1;
    /* pieces small enough to balance threads, large enough that claiming them costs nothing */
    int per = tiles / (8 * (nth > 0 ? nth : 1));
    if (per < 1) per = 1;
    matmul_task_args task = {{w, mem, sums, isums, M, out, ldo, accumulate}, kernels.tile[w->layout][w->kind], per};
    run_parallel(matmul_task, &task, (tiles + per - 1) / per, nth);
    if (profiling) profile_ns[1] += now_ns() - started;
}
