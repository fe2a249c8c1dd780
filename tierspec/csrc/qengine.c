/* tierspec's pass engine: linear layers that multiply with a GGUF file's own 4- and 8-bit blocks,
 * and a Llama decoder layer fused into one call (norms, rotary, KV write, attention, SwiGLU,
 * residuals), for the decode loop's passes of 1-16 new tokens (and prefills) on a CPU.
 *
 * Why it exists (measurements in BENCHMARKS.md, "Pass engines"): torch's int4/int8 packs are not
 * flat over 1-16 rows and cannot hold the file's fp16 scales; a pass through torch's per-layer
 * operators spends ~5 ms per pass of the default model outside its matrices. Here a weight tile is
 * de-quantised once per call and serves every row of the pass, and a layer is one call.
 *
 * Two properties the decode loop relies on, kept by construction:
 *  - Every output element is computed by one thread in an order fixed by the weights' shape alone,
 *    never by the number of rows in the pass or by which thread runs it, so a token's results do
 *    not depend on the other rows of its pass (tests check bitwise).
 *  - Attention walks each query's visible keys in logical order (the cached context, then the new
 *    tokens it sees, in pass order), whatever slots they sit in, so a token-tree node gets exactly
 *    the result of a chain pass of its path.
 *
 * Weights are exactly the file's: a Q4_0/Q4_1 weight is d*q + m (q in 0..15; Q4_0's m = -8d) and a
 * Q8_0 weight d*q (q in -128..127), d and m the block's fp16 values. Products:
 *  - layout A (AVX512-BF16): the rows rounded to bfloat16, sum_k q_k x_k in vdpbf16ps (q exact in
 *    bfloat16, float32 sums), then d * that + m * sum_k x_k per block, in float32;
 *  - layout B (AVX2/FMA, or any CPU through the portable C loop with the same order): float32 rows
 *    (or rows rounded to bfloat16 when asked), acc += (d*q_k) x_k in float32 (d*q is exact), and
 *    m * sum_k x_k per block.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
#include <time.h>

#if defined(__x86_64__) || defined(_M_X64)
#define QE_X86 1
#include <immintrin.h>
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,f16c,fma")))
#else
#define QE_X86 0
#endif

/* ---- formats ------------------------------------------------------------------------------- */

enum { KIND_Q4 = 0, KIND_Q8 = 1 };   /* Q4: Q4_0 and Q4_1 (w = d*q + m); Q8: Q8_0 (w = d*q) */
enum { LAYOUT_A = 0, LAYOUT_B = 1, LAYOUT_C = 2 }; /* A: bfloat16 dot products; B: float32 FMAs; C: 8-bit rows, int32 dot products */
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q8_0 = 8 }; /* ggml type ids */

#define TILE 16  /* output rows per tile */
#define SINGLE_THREAD_ROWS 2 /* products over this many rows or fewer run on one thread (see linear) */
#define PREFETCH_CELLS 48 /* how far ahead (in cells, ~15 KB) the kernels ask for weights: measured best of 2-96 */
#define QK 32    /* weights per block */

/* bytes of one (tile, block) cell */
static size_t cell_bytes(int kind) { return kind == KIND_Q4 ? 64 + 256 : 32 + 512; }

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

/* float -> fp16, round to nearest even (only used for Q4_0's m = -8d, which is exact) */
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

/* One GGUF block's values: d, m (fp16 bits) and q[32] (0..15 for Q4, -128..127 for Q8). */
static void read_gguf_block(int type, const uint8_t *src, uint16_t *d, uint16_t *m, int q[QK]) {
    if (type == GGUF_Q8_0) {
        memcpy(d, src, 2);
        *m = 0;
        for (int i = 0; i < QK; i++) q[i] = (int8_t)src[2 + i];
        return;
    }
    const uint8_t *qs;
    memcpy(d, src, 2);
    if (type == GGUF_Q4_1) {
        memcpy(m, src + 2, 2);
        qs = src + 4;
    } else { /* Q4_0: w = d*(q-8) = d*q + (-8d); -8d is exact in fp16 */
        *m = float_to_fp16(-8.0f * fp16_to_float(*d));
        qs = src + 2;
    }
    for (int i = 0; i < 16; i++) {
        q[i] = qs[i] & 0x0f;
        q[i + 16] = qs[i] >> 4;
    }
}

static size_t gguf_block_bytes(int type) { return type == GGUF_Q8_0 ? 34 : type == GGUF_Q4_1 ? 20 : 18; }

/* Where q(row r of the tile, k of the block) lives in a cell, as (byte offset in the q area, shift). */
static inline void q4_slot(int layout, int r, int k, int *byte, int *shift) {
    if (layout == LAYOUT_C) { /* quad g = k/4: 64 values at 4r + k%4; byte p holds values p (low) and 32 + p (high) */
        int pos = 4 * r + (k & 3);
        *byte = 32 * (k >> 2) + (pos & 31);
        *shift = pos >= 32 ? 4 : 0;
        return;
    }
    if (layout == LAYOUT_A) { /* pair p = k/2, word j = 2r + (k&1); 32-byte groups hold pairs (2g, 2g+1) */
        int p = k >> 1, j = 2 * r + (k & 1);
        *byte = 32 * (p >> 1) + j;
        *shift = (p & 1) ? 4 : 0;
    } else { /* per k: 8 bytes, byte j = rows j (low) and j+8 (high) */
        *byte = 8 * k + (r & 7);
        *shift = r >= 8 ? 4 : 0;
    }
}

static inline int q8_slot(int layout, int r, int k) {
    if (layout == LAYOUT_C) return 64 * (k >> 2) + 4 * r + (k & 3); /* quads of k per row */
    if (layout == LAYOUT_A) return 32 * (k >> 1) + 2 * r + (k & 1); /* pair-interleaved */
    return 16 * k + r;                                               /* per k: rows 0..15 */
}

/* A Q8 value as stored: layout C keeps q + 128 (unsigned, the operand vpdpbusd multiplies unsigned). */
static inline uint8_t q8_store(int layout, int q) { return layout == LAYOUT_C ? (uint8_t)(q + 128) : (uint8_t)(int8_t)q; }
static inline int q8_load(int layout, uint8_t v) { return layout == LAYOUT_C ? (int)v - 128 : (int)(int8_t)v; }

/* ---- the thread pool ------------------------------------------------------------------------ */

/* A task is ``chunks`` independent pieces of work (tiles of a product, (row, head) pairs of the
 * attention, rows of the SwiGLU), claimed one at a time from a shared counter by the calling thread
 * and any worker that is awake. So a worker that the OS has not scheduled (a busy machine) delays
 * nothing: the caller takes the pieces it would have taken. Which thread computes a piece does not
 * change its result (each output is computed whole by one thread). */

typedef void (*task_fn)(void *arg, int chunk);

/* Tasks alternate between two slots by generation, so a worker that wakes late for an old task
 * reads that task's (finished) slot while the caller fills the other; the caller waits for every
 * worker to leave a task before it reuses its slot. */
typedef struct {
    task_fn fn;
    void *arg;
    int chunks, helpers; /* helpers: how many workers may join */
    atomic_int next;     /* the next unclaimed chunk */
    atomic_int done;     /* chunks finished */
} task_slot;

#define MAX_THREADS 64
static struct {
    int workers;
    atomic_int generation; /* bumped when a task is posted */
    atomic_int active;     /* workers inside a task */
    atomic_int sleepers;
    atomic_int busy;       /* a task is running (another Python thread's pass runs alone) */
    task_slot slots[2];
    pthread_mutex_t mutex;
    pthread_cond_t wake;
} pool = {.mutex = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if QE_X86
    _mm_pause();
#endif
}

/* Spin this long for the next task before sleeping: a pass runs ~150 tasks with a few microseconds
 * of Python between layers; between passes the workers sleep. */
#define SPIN_ROUNDS 2000

static void claim_chunks(task_slot *task) {
    for (;;) {
        int c = atomic_fetch_add_explicit(&task->next, 1, memory_order_acq_rel);
        if (c >= task->chunks) return;
        task->fn(task->arg, c);
        atomic_fetch_add_explicit(&task->done, 1, memory_order_release);
    }
}

static int start_generation[MAX_THREADS];

/* Denormal inputs and results are flushed to zero inside the engine (as oneDNN does): products of
 * tiny attention weights with values would otherwise fall into slow microcoded paths, and their
 * contribution (below 1e-38) is nothing. The caller's floating-point state is restored after. */
static inline unsigned flush_denormals(void) {
#if QE_X86
    unsigned previous = _mm_getcsr();
    _mm_setcsr(previous | 0x8040); /* FTZ | DAZ */
    return previous;
#else
    return 0;
#endif
}

static inline void restore_denormals(unsigned previous) {
#if QE_X86
    _mm_setcsr(previous);
#else
    (void)previous;
#endif
}

static void *worker_main(void *raw) {
    int ith = (int)(intptr_t)raw;
    flush_denormals();
    int seen = start_generation[ith]; /* the generation when it was made: a task posted before it runs is still its */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen && spins < SPIN_ROUNDS) {
            cpu_relax();
            spins++;
        }
        if (atomic_load(&pool.generation) == seen) {
            pthread_mutex_lock(&pool.mutex);
            atomic_fetch_add(&pool.sleepers, 1);
            while (atomic_load(&pool.generation) == seen) pthread_cond_wait(&pool.wake, &pool.mutex);
            atomic_fetch_sub(&pool.sleepers, 1);
            pthread_mutex_unlock(&pool.mutex);
        }
        int g = atomic_load(&pool.generation);
        atomic_fetch_add(&pool.active, 1);
        if (atomic_load(&pool.generation) == g) { /* else a newer task was posted: see it next round */
            task_slot *task = &pool.slots[g & 1];
            if (ith <= task->helpers) claim_chunks(task);
        }
        atomic_fetch_sub(&pool.active, 1);
        seen = g;
    }
    return NULL;
}

/* A child process (fork) has none of the parent's workers: it starts with an empty pool. */
static void forget_workers_in_child(void) {
    pool.workers = 0;
    atomic_store(&pool.busy, 0);
    atomic_store(&pool.active, 0);
    atomic_store(&pool.sleepers, 0);
    pthread_mutex_init(&pool.mutex, NULL);
    pthread_cond_init(&pool.wake, NULL);
}

static int ensure_workers(int wanted) {
    static int registered = 0;
    if (!registered) {
        pthread_atfork(NULL, NULL, forget_workers_in_child);
        registered = 1;
    }
    if (wanted > MAX_THREADS - 1) wanted = MAX_THREADS - 1;
    while (pool.workers < wanted) {
        pthread_attr_t attr;
        pthread_t thread;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        start_generation[pool.workers + 1] = atomic_load(&pool.generation);
        int ok = pthread_create(&thread, &attr, worker_main, (void *)(intptr_t)(pool.workers + 1));
        pthread_attr_destroy(&attr);
        if (ok != 0) break;
        pool.workers++;
    }
    return pool.workers;
}

static inline void wait_until(atomic_int *value, int target, int at_least) {
    int spins = 0;
    while (at_least ? atomic_load_explicit(value, memory_order_acquire) < target
                    : atomic_load_explicit(value, memory_order_acquire) != target) {
        if (++spins > 256) sched_yield(); /* a worker holding a chunk was descheduled: let it run */
        else cpu_relax();
    }
}

/* Run fn(arg, c) for every chunk c in 0..chunks-1 on up to ``nth`` threads, the caller among them.
 * A pool already running a task (another Python thread's pass) is not shared: the caller runs the
 * chunks alone. */
static void run_parallel(task_fn fn, void *arg, int chunks, int nth) {
    if (nth > 1 && chunks > 1 && atomic_exchange(&pool.busy, 1) == 0) {
        int workers = ensure_workers(nth - 1);
        wait_until(&pool.active, 0, 0); /* nobody is still inside the slot about to be reused */
        int g = atomic_load(&pool.generation) + 1;
        task_slot *task = &pool.slots[g & 1];
        task->fn = fn;
        task->arg = arg;
        task->chunks = chunks;
        task->helpers = nth - 1 < workers ? nth - 1 : workers;
        atomic_store(&task->next, 0);
        atomic_store(&task->done, 0);
        atomic_store(&pool.generation, g);
        if (atomic_load(&pool.sleepers) > 0) {
            pthread_mutex_lock(&pool.mutex);
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.mutex);
        }
        claim_chunks(task);
        wait_until(&task->done, chunks, 1);
        atomic_store(&pool.busy, 0);
        return;
    }
    for (int c = 0; c < chunks; c++) fn(arg, c);
}

/* ---- CPU features --------------------------------------------------------------------------- */

static int cpu_avx512bf16 = 0, cpu_avx2 = 0, cpu_vnni = 0; /* set once at import (detect_cpu) */

/* TIERSPEC_ENGINE_ISA=avx2 or =portable (read once, at import) makes the engine use no more than
 * that instruction set, so the AVX2 and portable paths can be tested on a newer CPU. */
static void detect_cpu(void) {
    const char *cap = getenv("TIERSPEC_ENGINE_ISA");
    if (cap && strcmp(cap, "portable") == 0) return;
#if QE_X86 && defined(__GNUC__)
    __builtin_cpu_init();
    cpu_avx512bf16 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("avx512bf16");
    cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    cpu_vnni = cpu_avx512bf16 && __builtin_cpu_supports("avx512vnni");
    if (cap && strcmp(cap, "avx2") == 0) cpu_avx512bf16 = cpu_vnni = 0;
#endif
}

static inline int have_avx512bf16(void) { return cpu_avx512bf16; }
static inline int have_avx2(void) { return cpu_avx2; }

static int force_portable = 0; /* tests: the portable C loops on any CPU */

/* Where a layer call's time goes (benchmarks/pass_cost.py): on only when asked. */
static int profiling = 0;
static int64_t profile_ns[4]; /* whole layer calls, matrix products (rows prepared + products), attention, calls */

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* ---- row preparation ----------------------------------------------------------------------- */

/* Rows as the kernels read them: layout A wants bfloat16 rows; layout B float32 rows, rounded to
 * bfloat16 values when ``round_bf16``. sums[m][b]: the block sums of the rows as used, in a fixed
 * order: 8 lanes (element i of the block in lane i % 8, summed in order of i), then the lanes
 * pairwise ((0+4)+(2+6)) + ((1+5)+(3+7)) — what the AVX2 code does, so both agree bitwise. */
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

static void prepare_rows_portable(int layout, int round_bf16, const float *x, int M, int K, void *xbuf, float *sums) {
    int KB = K / QK;
    float block[QK];
    for (int m = 0; m < M; m++) {
        const float *row = x + (size_t)m * K;
        for (int b = 0; b < KB; b++) {
            for (int i = 0; i < QK; i++) {
                float v = row[b * QK + i];
                if (layout == LAYOUT_A) {
                    uint16_t h = float_to_bf16(v);
                    ((uint16_t *)xbuf)[(size_t)m * K + b * QK + i] = h;
                    v = bf16_to_float(h);
                } else {
                    if (round_bf16) v = bf16_to_float(float_to_bf16(v));
                    ((float *)xbuf)[(size_t)m * K + b * QK + i] = v;
                }
                block[i] = v;
            }
            sums[(size_t)m * KB + b] = block_sum(block);
        }
    }
}

#if QE_X86
AVX512_TARGET static void prepare_rows_avx512(const float *x, int M, int K, uint16_t *xbuf, float *sums) {
    int KB = K / QK;
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(v + 16), _mm512_loadu_ps(v));
            _mm512_storeu_si512((void *)(xbuf + (size_t)m * K + b * QK), (__m512i)h);
            __m512i bits = (__m512i)h; /* bfloat16 -> float32: the 16 bits on top */
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
            sums[(size_t)m * KB + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
}

AVX2_TARGET static void prepare_rows_avx2(int round_bf16, const float *x, int M, int K, float *xbuf, float *sums) {
    int KB = K / QK;
    const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), top = _mm256_set1_epi32((int)0xffff0000);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            float *out = xbuf + (size_t)m * K + b * QK;
            __m256 lane = _mm256_setzero_ps();
            for (int i = 0; i < QK; i += 8) {
                __m256 r = _mm256_loadu_ps(v + i);
                if (round_bf16) { /* round to nearest even at bit 16, as float_to_bf16 (finite values) */
                    __m256i bits = _mm256_castps_si256(r);
                    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
                    bits = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), top);
                    r = _mm256_castsi256_ps(bits);
                }
                _mm256_storeu_ps(out + i, r);
                lane = i ? _mm256_add_ps(lane, r) : r;
            }
            __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(lane), _mm256_extractf128_ps(lane, 1)); /* j + (j+4) */
            __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                   /* (0+2), (1+3) */
            sums[(size_t)m * KB + b] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
        }
}
#endif

static void prepare_rows(int layout, int round_bf16, const float *x, int M, int K, void *xbuf, float *sums) {
#if QE_X86
    if (!force_portable && layout == LAYOUT_A && have_avx512bf16()) {
        prepare_rows_avx512(x, M, K, xbuf, sums);
        return;
    }
    if (!force_portable && layout == LAYOUT_B && have_avx2()) {
        prepare_rows_avx2(round_bf16, x, M, K, xbuf, sums);
        return;
    }
#endif
    prepare_rows_portable(layout, round_bf16, x, M, K, xbuf, sums);
}

/* Layout C's rows: each block of 32 values as 8-bit integers q = round(x / s) with s = max|x| / 127
 * (as llama.cpp rounds its activations), the scale s and the sum of q per block. Every step is an
 * exact or correctly rounded operation, so the vector version gives the same bytes. */
static void prepare_rows_int8_portable(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums) {
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

#if QE_X86
AVX512_TARGET static void prepare_rows_int8_avx512(const float *x, int M, int K, int8_t *xq, float *scales, int32_t *isums) {
    int KB = K / QK;
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (int m = 0; m < M; m++)
        for (int b = 0; b < KB; b++) {
            const float *v = x + (size_t)m * K + b * QK;
            __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a0), _mm512_andnot_ps(sign, a1)));
            float scale = amax / 127.0f;
            __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
            if (scale > 0.0f) {
                __m512 sv = _mm512_set1_ps(scale);
                q0 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(a0, sv))));
                q1 = _mm512_max_epi32(lo, _mm512_min_epi32(hi, _mm512_cvtps_epi32(_mm512_div_ps(a1, sv))));
            }
            _mm_storeu_si128((__m128i *)(xq + (size_t)m * K + b * QK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + (size_t)m * K + b * QK + 16), _mm512_cvtepi32_epi8(q1));
            scales[(size_t)m * KB + b] = scale;
            isums[(size_t)m * KB + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
}
#endif


static void prepare_rows_int8(const float *x, int M, int K, void *xq, float *scales, int32_t *isums) {
#if QE_X86
    if (!force_portable && cpu_vnni) {
        prepare_rows_int8_avx512(x, M, K, xq, scales, isums);
        return;
    }
#endif
    prepare_rows_int8_portable(x, M, K, xq, scales, isums);
}

/* ---- matrix kernels ------------------------------------------------------------------------- */

typedef struct {
    int kind, layout;
    const uint8_t *w;
    int N, K;
    const void *x;      /* A: uint16 bfloat16 [M, K]; B: float [M, K]; C: int8 [M, K] */
    const float *sums;  /* A, B: block sums [M, K/32]; C: block scales [M, K/32] */
    const int32_t *isums; /* C: block sums of the 8-bit values [M, K/32] */
    int M;
    float *out;
    int ldo;        /* out row stride (floats) */
    int accumulate; /* out += result instead of out = result */
    int tiles_per_chunk;
} matmul_args;

static inline void store_tile(const matmul_args *a, int m, int n0, const float *vals) {
    float *dst = a->out + (size_t)m * a->ldo + n0;
    int count = a->N - n0 < TILE ? a->N - n0 : TILE;
    if (a->accumulate)
        for (int i = 0; i < count; i++) dst[i] += vals[i];
    else
        for (int i = 0; i < count; i++) dst[i] = vals[i];
}

/* Portable kernel. Layout B: the same operations, in the same order per output, as the AVX2 one
 * (so the two agree bitwise). Layout A: the same maths as the AVX512-BF16 one (bfloat16 rows, the
 * block's sum of q*x before its scale), summed in another order: close, not bitwise. */
static void tile_portable(const matmul_args *a, int t, int m0, int mt) {
    int KB = a->K / QK;
    float acc[8][TILE];
    for (int i = 0; i < mt; i++)
        for (int r = 0; r < TILE; r++) acc[i][r] = 0.0f;
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = a->w + ((size_t)t * KB + b) * cell_bytes(a->kind);
        float d[TILE], mn[TILE];
        for (int r = 0; r < TILE; r++) {
            uint16_t h;
            memcpy(&h, cell + 2 * r, 2);
            d[r] = fp16_to_float(h);
            mn[r] = 0.0f;
            if (a->kind == KIND_Q4) {
                memcpy(&h, cell + 32 + 2 * r, 2);
                mn[r] = fp16_to_float(h);
            }
        }
        const uint8_t *q = cell + (a->kind == KIND_Q4 ? 64 : 32);
        int v[QK][TILE];
        for (int k = 0; k < QK; k++)
            for (int r = 0; r < TILE; r++) {
                if (a->kind == KIND_Q4) {
                    int byte, shift;
                    q4_slot(a->layout, r, k, &byte, &shift);
                    v[k][r] = (q[byte] >> shift) & 0x0f;
                } else {
                    v[k][r] = q8_load(a->layout, q[q8_slot(a->layout, r, k)]);
                }
            }
        for (int i = 0; i < mt; i++) {
            size_t row = (size_t)(m0 + i) * a->K + (size_t)b * QK;
            float s = a->sums[(size_t)(m0 + i) * KB + b];
            if (a->layout == LAYOUT_C) { /* the VNNI kernel's arithmetic exactly: an int32 dot, then float */
                const int8_t *x = (const int8_t *)a->x + row;
                int32_t isum = a->isums[(size_t)(m0 + i) * KB + b];
                for (int r = 0; r < TILE; r++) {
                    int32_t dot = 0;
                    for (int k = 0; k < QK; k++) dot += v[k][r] * x[k];
                    acc[i][r] = fmaf((float)dot, d[r] * s, acc[i][r]);
                    if (a->kind == KIND_Q4) acc[i][r] = fmaf(mn[r], s * (float)isum, acc[i][r]);
                }
                continue;
            }
            if (a->layout == LAYOUT_B) {
                const float *x = (const float *)a->x + row;
                for (int k = 0; k < QK; k++)
                    for (int r = 0; r < TILE; r++) acc[i][r] = fmaf(d[r] * (float)v[k][r], x[k], acc[i][r]);
                if (a->kind == KIND_Q4)
                    for (int r = 0; r < TILE; r++) acc[i][r] = fmaf(mn[r], s, acc[i][r]);
            } else {
                const uint16_t *x = (const uint16_t *)a->x + row;
                for (int r = 0; r < TILE; r++) {
                    float dot = 0.0f;
                    for (int k = 0; k < QK; k++) dot = fmaf((float)v[k][r], bf16_to_float(x[k]), dot);
                    acc[i][r] = fmaf(dot, d[r], acc[i][r]);
                    if (a->kind == KIND_Q4) acc[i][r] = fmaf(mn[r], s, acc[i][r]);
                }
            }
        }
    }
    for (int i = 0; i < mt; i++) store_tile(a, m0 + i, t * TILE, acc[i]);
}

#if QE_X86

/* Layout B, 8 float lanes = 8 output rows; two halves of the tile; up to 4 rows of x at once. */
AVX2_TARGET static inline void tile_avx2_mt(const matmul_args *a, int t, int m0, const int mt) {
    int KB = a->K / QK;
    const float *x = (const float *)a->x;
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < mt; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(0x0f);
    size_t cb = cell_bytes(a->kind);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = a->w + ((size_t)t * KB + b) * cb;
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)cell));
        __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 16)));
        const float *xb = x + (size_t)m0 * a->K + b * QK;
        if (a->kind == KIND_Q4) {
            const uint8_t *q = cell + 64;
            for (int k = 0; k < QK; k++) {
                __m256i raw = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * k)));
                __m256 w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_and_si256(raw, low)));
                __m256 w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_srli_epi32(raw, 4)));
                for (int i = 0; i < mt; i++) {
                    __m256 xv = _mm256_broadcast_ss(xb + (size_t)i * a->K + k);
                    acc0[i] = _mm256_fmadd_ps(w0, xv, acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w1, xv, acc1[i]);
                }
            }
            __m256 n0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 32)));
            __m256 n1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cell + 48)));
            for (int i = 0; i < mt; i++) {
                __m256 s = _mm256_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]);
                acc0[i] = _mm256_fmadd_ps(n0, s, acc0[i]);
                acc1[i] = _mm256_fmadd_ps(n1, s, acc1[i]);
            }
        } else {
            const uint8_t *q = cell + 32;
            for (int k = 0; k < QK; k++) {
                __m256 w0 = _mm256_mul_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * k)))));
                __m256 w1 = _mm256_mul_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * k + 8)))));
                for (int i = 0; i < mt; i++) {
                    __m256 xv = _mm256_broadcast_ss(xb + (size_t)i * a->K + k);
                    acc0[i] = _mm256_fmadd_ps(w0, xv, acc0[i]);
                    acc1[i] = _mm256_fmadd_ps(w1, xv, acc1[i]);
                }
            }
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm256_storeu_ps(vals, acc0[i]);
        _mm256_storeu_ps(vals + 8, acc1[i]);
        store_tile(a, m0 + i, t * TILE, vals);
    }
}

AVX2_TARGET static void tile_avx2(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_avx2_mt(a, t, m0, 1); break;
    case 2: tile_avx2_mt(a, t, m0, 2); break;
    case 3: tile_avx2_mt(a, t, m0, 3); break;
    default: tile_avx2_mt(a, t, m0, 4); break;
    }
}

/* Layout A: 16 float lanes = the tile's 16 output rows; each vdpbf16ps adds two k's products.
 * Per block: the sum of q_k x_k (bfloat16 products, float32 sums), then acc += d * it + m * sum x. */
AVX512_TARGET static inline void tile_avx512_mt(const matmul_args *a, int t, int m0, const int mt) {
    int KB = a->K / QK;
    const uint32_t *x = (const uint32_t *)a->x; /* bfloat16 pairs */
    int K2 = a->K / 2;
    /* per row and block two running sums (even and odd pairs of k), added at the block's end: twice
     * the independent vdpbf16ps chains, whose latency bounds a product over few rows otherwise */
    __m512 acc[8], even[8], odd[8];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f);
    size_t cb = cell_bytes(a->kind);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = a->w + ((size_t)t * KB + b) * cb;
        /* the cells a few blocks ahead (the next tile's first ones at a tile's end): a pass over
         * several rows computes long enough per cell that the loads must be asked for early */
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
        const uint32_t *xb = x + (size_t)m0 * K2 + b * (QK / 2);
        for (int i = 0; i < mt; i++) even[i] = odd[i] = _mm512_setzero_ps();
        if (a->kind == KIND_Q4) {
            /* A nibble q OR-ed into 0x4300 is the bfloat16 of 128 + q (exact): one instruction where a
             * table lookup took one on the shuffle unit. So the block's dot product is of (128 + q),
             * and w = d*q + m = d*(128 + q) + (m - 128 d) takes the offset into the minimum's term. */
            const uint8_t *q = cell + 64;
            const __m512i bias = _mm512_set1_epi16(0x4300);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(raw, low, bias, 0xEA); /* (raw & low) | bias */
                __m512bh w1 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(raw, 4), bias);
                for (int i = 0; i < mt; i++) {
                    const uint32_t *xr = xb + (size_t)i * K2 + 2 * g;
                    even[i] = _mm512_dpbf16_ps(even[i], w0, (__m512bh)_mm512_set1_epi32((int)xr[0]));
                    odd[i] = _mm512_dpbf16_ps(odd[i], w1, (__m512bh)_mm512_set1_epi32((int)xr[1]));
                }
            }
            __m512 mn = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0f),
                                        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32))));
            for (int i = 0; i < mt; i++) {
                acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d, acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
        } else {
            const uint8_t *q = cell + 32;
            for (int p = 0; p < 16; p++) {
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p))));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16))));
                __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
                if (p & 1)
                    for (int i = 0; i < mt; i++)
                        odd[i] = _mm512_dpbf16_ps(odd[i], w, (__m512bh)_mm512_set1_epi32((int)xb[(size_t)i * K2 + p]));
                else
                    for (int i = 0; i < mt; i++)
                        even[i] = _mm512_dpbf16_ps(even[i], w, (__m512bh)_mm512_set1_epi32((int)xb[(size_t)i * K2 + p]));
            }
            for (int i = 0; i < mt; i++) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), d, acc[i]);
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t * TILE, vals);
    }
}

AVX512_TARGET static void tile_avx512(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_avx512_mt(a, t, m0, 1); break;
    case 2: tile_avx512_mt(a, t, m0, 2); break;
    case 3: tile_avx512_mt(a, t, m0, 3); break;
    case 4: tile_avx512_mt(a, t, m0, 4); break;
    case 5: tile_avx512_mt(a, t, m0, 5); break;
    case 6: tile_avx512_mt(a, t, m0, 6); break;
    case 7: tile_avx512_mt(a, t, m0, 7); break;
    default: tile_avx512_mt(a, t, m0, 8); break;
    }
}
#endif

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
#define VNNI_ROWS 8

/* Layout C: 16 int32 lanes = the tile's rows; each vpdpbusd adds four k's products of unsigned
 * 8-bit weights (a Q4 nibble 0..15, or a Q8 value + 128) with the row's signed 8-bit values. Per
 * block: the exact int32 dot (a Q8 block's less 128 * the row's sum), then acc += dot * (d * s)
 * (+ m * (s * sum) for Q4), in float32: what the portable loop does. */
VNNI_TARGET static inline void tile_vnni_mt(const matmul_args *a, int t, int m0, const int mt) {
    int KB = a->K / QK;
    const int32_t *x = (const int32_t *)a->x; /* quads of int8 */
    int K4 = a->K / 4;
    __m512 acc[VNNI_ROWS];
    __m512i even[VNNI_ROWS], odd[VNNI_ROWS];
    for (int i = 0; i < mt; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    size_t cb = cell_bytes(a->kind);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = a->w + ((size_t)t * KB + b) * cb;
        for (size_t line = 0; line < cb; line += 64) _mm_prefetch((const char *)(cell + PREFETCH_CELLS * cb + line), _MM_HINT_T0);
        const int32_t *xb = x + (size_t)m0 * K4 + b * (QK / 4);
        for (int i = 0; i < mt; i++) even[i] = odd[i] = _mm512_setzero_si512();
        if (a->kind == KIND_Q4) {
            const uint8_t *q = cell + 64;
            for (int g = 0; g < 8; g += 2) {
                __m256i r0 = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
                __m256i r1 = _mm256_loadu_si256((const __m256i *)(q + 32 * g + 32));
                __m512i w0 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r0), _mm256_srli_epi16(r0, 4), 1), low);
                __m512i w1 = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r1), _mm256_srli_epi16(r1, 4), 1), low);
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4 + g;
                    even[i] = _mm512_dpbusd_epi32(even[i], w0, _mm512_set1_epi32(xr[0]));
                    odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(xr[1]));
                }
            }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32)));
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[i], odd[i]));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s * (float)a->isums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
        } else {
            const uint8_t *q = cell + 32;
            for (int g = 0; g < 8; g += 2) {
                __m512i w0 = _mm512_loadu_si512((const void *)(q + 64 * g));
                __m512i w1 = _mm512_loadu_si512((const void *)(q + 64 * g + 64));
                for (int i = 0; i < mt; i++) {
                    const int32_t *xr = xb + (size_t)i * K4 + g;
                    even[i] = _mm512_dpbusd_epi32(even[i], w0, _mm512_set1_epi32(xr[0]));
                    odd[i] = _mm512_dpbusd_epi32(odd[i], w1, _mm512_set1_epi32(xr[1]));
                }
            }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512i offset = _mm512_set1_epi32(128 * a->isums[(size_t)(m0 + i) * KB + b]);
                __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even[i], odd[i]), offset));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
            }
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t * TILE, vals);
    }
}

VNNI_TARGET static void tile_vnni(const matmul_args *a, int t, int m0, int mt) {
    switch (mt) {
    case 1: tile_vnni_mt(a, t, m0, 1); break;
    case 2: tile_vnni_mt(a, t, m0, 2); break;
    case 3: tile_vnni_mt(a, t, m0, 3); break;
    case 4: tile_vnni_mt(a, t, m0, 4); break;
    case 5: tile_vnni_mt(a, t, m0, 5); break;
    case 6: tile_vnni_mt(a, t, m0, 6); break;
    case 7: tile_vnni_mt(a, t, m0, 7); break;
    default: tile_vnni_mt(a, t, m0, 8); break;
    }
}

static int use_vnni(int layout) { return QE_X86 && layout == LAYOUT_C && !force_portable && cpu_vnni; }

static int use_avx512(int layout) { return QE_X86 && layout == LAYOUT_A && !force_portable && have_avx512bf16(); }
static int use_avx2(int layout) { return QE_X86 && layout == LAYOUT_B && !force_portable && have_avx2(); }

static void matmul_task(void *raw, int chunk) {
    const matmul_args *a = (const matmul_args *)raw;
    int tiles = (a->N + TILE - 1) / TILE;
    int t0 = chunk * a->tiles_per_chunk, t1 = t0 + a->tiles_per_chunk < tiles ? t0 + a->tiles_per_chunk : tiles;
    int rows_per = 8;
#if QE_X86
    if (use_avx2(a->layout)) rows_per = 4;
    if (use_vnni(a->layout)) rows_per = VNNI_ROWS;
#endif
    for (int t = t0; t < t1; t++) {
        for (int m0 = 0; m0 < a->M; m0 += rows_per) {
            int mt = a->M - m0 < rows_per ? a->M - m0 : rows_per;
#if QE_X86
            if (use_avx512(a->layout)) { tile_avx512(a, t, m0, mt); continue; }
            if (use_vnni(a->layout)) { tile_vnni(a, t, m0, mt); continue; }
            if (use_avx2(a->layout)) { tile_avx2(a, t, m0, mt); continue; }
#endif
            tile_portable(a, t, m0, mt);
        }
    }
}

/* ---- vector maths --------------------------------------------------------------------------- */

/* exp(x): Cephes' polynomial after a range reduction by ln 2 (~1 ulp), x clamped above at 88.376
 * (exp is then ~2.4e38) and 0 below -87.336 (where the result would be subnormal). The vector
 * versions below do the same operations, so every element gets the same value whichever code or
 * lane computes it. */
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

static inline float exp_scalar(float x) {
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

#if QE_X86
AVX512_TARGET static inline __m512 exp16(__m512 x) {
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~zero, p, _mm512_castsi512_ps(e));
}

AVX2_TARGET static inline __m256 exp8(__m256 x) {
    __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_LO), _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

#if QE_X86
AVX512_TARGET static void exp_inplace_avx512(float *v, int count) {
    int i = 0;
    for (; i + 16 <= count; i += 16) _mm512_storeu_ps(v + i, exp16(_mm512_loadu_ps(v + i)));
    if (i < count) {
        __mmask16 tail = (__mmask16)((1u << (count - i)) - 1);
        _mm512_mask_storeu_ps(v + i, tail, exp16(_mm512_maskz_loadu_ps(tail, v + i)));
    }
}

AVX2_TARGET static void exp_inplace_avx2(float *v, int count) {
    int i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(v + i, exp8(_mm256_loadu_ps(v + i)));
    for (; i < count; i++) v[i] = exp_scalar(v[i]);
}
#endif

/* exp of count values in place: vectors where the CPU has them, the same values either way. */
static void exp_inplace(float *v, int count) {
#if QE_X86
    if (!force_portable && have_avx512bf16()) { exp_inplace_avx512(v, count); return; }
    if (!force_portable && have_avx2()) { exp_inplace_avx2(v, count); return; }
#endif
    for (int i = 0; i < count; i++) v[i] = exp_scalar(v[i]);
}

/* A sum in a fixed order (the values in logical order): 16 running lanes, then the lanes pairwise. */
static float sum_in_order(const float *v, int count) {
    float lanes[16] = {0};
    int i = 0;
    for (; i + 16 <= count; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += v[i + j];
    for (int j = 0; i < count; i++, j++) lanes[j] += v[i];
    for (int width = 8; width >= 1; width /= 2)
        for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
    return lanes[0];
}

/* ---- the Llama layer ------------------------------------------------------------------------ */

typedef struct {
    int kind, layout;
    const uint8_t *w;
    int N, K;
} qweight;

typedef struct {
    qweight qkv, o, gate_up, down;
    const float *norm_in, *norm_post;
    float eps;
    int hidden, heads, kv_heads, head_dim, inter;
    int round_bf16; /* layout B: round rows to bfloat16 values (emulated bfloat16) */
} layer_desc;

typedef struct {
    void *buf;
    size_t size;
} scratch_t;

static void *scratch_get(scratch_t *s, size_t bytes) {
    if (s->size < bytes) {
        free(s->buf);
        size_t size = bytes + (bytes >> 2) + 4096;
        s->buf = aligned_alloc(64, (size + 63) & ~(size_t)63);
        s->size = s->buf ? size : 0;
        if (!s->buf) { /* no Python error can be raised here (the GIL is released): say it and stop */
            fprintf(stderr, "tierspec pass engine: out of memory for %zu bytes of scratch\n", bytes);
            abort();
        }
    }
    return s->buf;
}

static _Thread_local scratch_t scratch_main, scratch_rows, scratch_scores;

/* x / rms(x) * w over one row (float32). The sum of squares in 16 (8) lanes where vectors are used,
 * reduced in a fixed order; the same on every row. */
#if QE_X86
AVX512_TARGET static void rms_norm_avx512(const float *x, const float *w, float eps, int n, float *out) {
    __m512 ss = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) ss = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(x + i), ss);
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
    for (int i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), r), _mm512_loadu_ps(w + i)));
}

AVX2_TARGET static void rms_norm_avx2(const float *x, const float *w, float eps, int n, float *out) {
    __m256 ss = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) ss = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), ss);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(ss), _mm256_extractf128_ps(ss, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m256 r = _mm256_set1_ps(1.0f / sqrtf(_mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) / (float)n + eps));
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}
#endif

static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
#if QE_X86
    if (!force_portable && n % 16 == 0 && have_avx512bf16()) { rms_norm_avx512(x, w, eps, n, out); return; }
    if (!force_portable && n % 8 == 0 && have_avx2()) { rms_norm_avx2(x, w, eps, n, out); return; }
#endif
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss = fmaf(x[i], x[i], ss);
    float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static int row_bytes(int layout) { return layout == LAYOUT_A ? 2 : layout == LAYOUT_C ? 1 : 4; }

/* x [M, K] float -> the kernels' rows, then out (+)= x W^T on nth threads. */
static void linear_body(const qweight *w, int round_bf16, const float *x, int M, float *out, int ldo, int accumulate,
                        int nth);

static void linear(const qweight *w, int round_bf16, const float *x, int M, float *out, int ldo, int accumulate,
                   int nth) {
    int64_t started = profiling ? now_ns() : 0;
    linear_body(w, round_bf16, x, M, out, ldo, accumulate, nth);
    if (profiling) profile_ns[1] += now_ns() - started;
}

static void linear_body(const qweight *w, int round_bf16, const float *x, int M, float *out, int ldo, int accumulate,
                        int nth) {
    int KB = w->K / QK;
    size_t rows_bytes = ((size_t)M * w->K * row_bytes(w->layout) + 63) & ~(size_t)63;
    char *mem = scratch_get(&scratch_rows, rows_bytes + (size_t)M * KB * 8 + 128);
    void *xbuf = mem;
    float *sums = (float *)(mem + rows_bytes);
    int32_t *isums = (int32_t *)(mem + rows_bytes + (((size_t)M * KB * 4 + 63) & ~(size_t)63));
    if (w->layout == LAYOUT_C) prepare_rows_int8(x, M, w->K, xbuf, sums, isums);
    else prepare_rows(w->layout, round_bf16, x, M, w->K, xbuf, sums);
    int tiles = (w->N + TILE - 1) / TILE;
    /* a small product is not worth waking the other threads for; and a product over one or two rows
     * streams weights faster than they are used, which one thread with prefetching nearly saturates
     * (measured here: whole passes of 1 / 2 rows took 3.0 / 3.8 ms on one thread, 3.6 / 4.0 on two;
     * two threads win from 4 rows on) */
    if ((int64_t)w->N * w->K * (M < 4 ? M : 4) < 65536 || M <= SINGLE_THREAD_ROWS) nth = 1;
    /* pieces small enough to balance threads, large enough that claiming them costs nothing */
    int per = tiles / (8 * (nth > 0 ? nth : 1));
    if (per < 1) per = 1;
    matmul_args a = {w->kind, w->layout, w->w, w->N, w->K, xbuf, sums, isums, M, out, ldo, accumulate, per};
    run_parallel(matmul_task, &a, (tiles + per - 1) / per, nth);
}

typedef struct {
    const layer_desc *L;
    const float *q;        /* [n, heads * D], rotated */
    const float *keys;     /* [kv_heads, cap, D] */
    const float *values;
    int cap, start, n;
    const uint8_t *attends; /* [n, n] or NULL (causal chain); [n, start + n] when ``full`` */
    float *out;            /* [n, heads * D] */
    int full;
} attention_args;

/* The slots a query sees, in logical order: the cached context, then the new tokens it sees. */
static int visible_slots(const attention_args *a, int row, int *slots) {
    int count = 0;
    if (a->full) { /* attends: [n, start + n] over every slot (the draft head's token trees) */
        for (int s = 0; s < a->start + a->n; s++)
            if (a->attends[(size_t)row * (a->start + a->n) + s]) slots[count++] = s;
        return count;
    }
    for (int s = 0; s < a->start; s++) slots[count++] = s;
    for (int j = 0; j <= row; j++)
        if (a->attends == NULL || a->attends[(size_t)row * a->n + j]) slots[count++] = a->start + j;
    return count;
}

/* One query's attention over its visible keys, in logical order. */
static void attend_one(const attention_args *a, int row, int head, float *scores, int *slots) {
    const layer_desc *L = a->L;
    int D = L->head_dim, group = L->heads / L->kv_heads, g = head / group;
    const float *q = a->q + (size_t)row * L->heads * D + (size_t)head * D;
    const float *K = a->keys + (size_t)g * a->cap * D, *V = a->values + (size_t)g * a->cap * D;
    int count = visible_slots(a, row, slots);
    float scale = 1.0f / sqrtf((float)D), best = -INFINITY;
    for (int l = 0; l < count; l++) {
        const float *k = K + (size_t)slots[l] * D;
        float s = 0.0f;
        for (int i = 0; i < D; i++) s = fmaf(q[i], k[i], s);
        s *= scale;
        scores[l] = s;
        if (s > best) best = s;
    }
    for (int l = 0; l < count; l++) scores[l] -= best;
    exp_inplace(scores, count);
    float total = sum_in_order(scores, count);
    float *out = a->out + (size_t)row * L->heads * D + (size_t)head * D;
    for (int i = 0; i < D; i++) out[i] = 0.0f;
    for (int l = 0; l < count; l++) {
        const float *v = V + (size_t)slots[l] * D;
        float p = scores[l];
        for (int i = 0; i < D; i++) out[i] = fmaf(p, v[i], out[i]);
    }
    float inv = 1.0f / total;
    for (int i = 0; i < D; i++) out[i] *= inv;
}

#if QE_X86
/* The same computation vectorised over the head dimension, the width a compile-time constant (D =
 * 32, 64 or 128) so that the query and the sums stay in registers. Per key one dot product reduced
 * in a fixed order; the weighted sum of values over the logical order in two interleaved sums (even
 * and odd keys: two independent FMA chains), added at the end. */
AVX512_TARGET static inline void attend_head_avx512(const attention_args *a, int row, int head, float *scores,
                                                   const int *slots, int count, const int chunks) {
    const layer_desc *L = a->L;
    int D = 16 * chunks, g = head / (L->heads / L->kv_heads);
    const float *q = a->q + (size_t)row * L->heads * D + (size_t)head * D;
    const float *K = a->keys + (size_t)g * a->cap * D, *V = a->values + (size_t)g * a->cap * D;
    float scale = 1.0f / sqrtf((float)D), top = -INFINITY;
    __m512 qv[8];
    for (int c = 0; c < chunks; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);
    for (int l = 0; l < count; l++) {
        const float *k = K + (size_t)slots[l] * D;
        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int c = 1; c < chunks; c++) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), s);
        float v = _mm512_reduce_add_ps(s) * scale;
        scores[l] = v;
        top = v > top ? v : top;
    }
    /* exp(score - top) and their sum, 16 at a time in logical order */
    __m512 shift = _mm512_set1_ps(top), sums = _mm512_setzero_ps();
    int l16 = 0;
    for (; l16 + 16 <= count; l16 += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + l16), shift));
        _mm512_storeu_ps(scores + l16, e);
        sums = _mm512_add_ps(sums, e);
    }
    if (l16 < count) {
        __mmask16 tail = (__mmask16)((1u << (count - l16)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + l16), shift));
        _mm512_mask_storeu_ps(scores + l16, tail, e);
        sums = _mm512_add_ps(sums, _mm512_maskz_mov_ps(tail, e));
    }
    float total = _mm512_reduce_add_ps(sums);
    __m512 even[8], odd[8];
    for (int c = 0; c < chunks; c++) even[c] = odd[c] = _mm512_setzero_ps();
    int l = 0;
    for (; l + 1 < count; l += 2) {
        const float *v0 = V + (size_t)slots[l] * D, *v1 = V + (size_t)slots[l + 1] * D;
        __m512 p0 = _mm512_set1_ps(scores[l]), p1 = _mm512_set1_ps(scores[l + 1]);
        for (int c = 0; c < chunks; c++) {
            even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
            odd[c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * c), odd[c]);
        }
    }
    if (l < count) {
        const float *v0 = V + (size_t)slots[l] * D;
        __m512 p0 = _mm512_set1_ps(scores[l]);
        for (int c = 0; c < chunks; c++) even[c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * c), even[c]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / total);
    float *out = a->out + (size_t)row * L->heads * D + (size_t)head * D;
    for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inv));
}

AVX2_TARGET static inline void attend_head_avx2(const attention_args *a, int row, int head, float *scores,
                                               const int *slots, int count, const int chunks) {
    const layer_desc *L = a->L;
    int D = 8 * chunks, g = head / (L->heads / L->kv_heads);
    const float *q = a->q + (size_t)row * L->heads * D + (size_t)head * D;
    const float *K = a->keys + (size_t)g * a->cap * D, *V = a->values + (size_t)g * a->cap * D;
    float scale = 1.0f / sqrtf((float)D), top = -INFINITY;
    for (int l = 0; l < count; l++) {
        const float *k = K + (size_t)slots[l] * D;
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k));
        for (int c = 1; c < chunks; c++) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), s);
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        r = _mm_add_ps(r, _mm_movehl_ps(r, r));
        r = _mm_add_ss(r, _mm_movehdup_ps(r));
        float v = _mm_cvtss_f32(r) * scale;
        scores[l] = v;
        top = v > top ? v : top;
    }
    for (int l = 0; l < count; l++) scores[l] -= top;
    exp_inplace(scores, count);
    float total = sum_in_order(scores, count);
    __m256 even[16], odd[16];
    for (int c = 0; c < chunks; c++) even[c] = odd[c] = _mm256_setzero_ps();
    int l = 0;
    for (; l + 1 < count; l += 2) {
        const float *v0 = V + (size_t)slots[l] * D, *v1 = V + (size_t)slots[l + 1] * D;
        __m256 p0 = _mm256_set1_ps(scores[l]), p1 = _mm256_set1_ps(scores[l + 1]);
        for (int c = 0; c < chunks; c++) {
            even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
            odd[c] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + 8 * c), odd[c]);
        }
    }
    if (l < count) {
        const float *v0 = V + (size_t)slots[l] * D;
        __m256 p0 = _mm256_set1_ps(scores[l]);
        for (int c = 0; c < chunks; c++) even[c] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * c), even[c]);
    }
    __m256 inv = _mm256_set1_ps(1.0f / total);
    float *out = a->out + (size_t)row * L->heads * D + (size_t)head * D;
    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_add_ps(even[c], odd[c]), inv));
}

/* Dispatch on the head width (a compile-time constant in each kernel); 0: no vector kernel for it. */
AVX512_TARGET static int attend_avx512(const attention_args *a, int row, int head, float *scores, const int *slots,
                                       int count) {
    switch (a->L->head_dim) {
    case 32: attend_head_avx512(a, row, head, scores, slots, count, 2); return 1;
    case 64: attend_head_avx512(a, row, head, scores, slots, count, 4); return 1;
    case 128: attend_head_avx512(a, row, head, scores, slots, count, 8); return 1;
    default: return 0;
    }
}

AVX2_TARGET static int attend_avx2(const attention_args *a, int row, int head, float *scores, const int *slots,
                                   int count) {
    switch (a->L->head_dim) {
    case 32: attend_head_avx2(a, row, head, scores, slots, count, 4); return 1;
    case 64: attend_head_avx2(a, row, head, scores, slots, count, 8); return 1;
    case 128: attend_head_avx2(a, row, head, scores, slots, count, 16); return 1;
    default: return 0;
    }
}
#endif

/* The rows of one pass, in segments: each segment one sequence's new rows with its own cache (a
 * batch of sequences shares the products; attention is per sequence, over its own cache). */
typedef struct {
    int row0, n, start, cap, full;
    float *keys, *values;   /* this layer's buffers of the sequence */
    const uint8_t *attends; /* [n, n], [n, start + n] (full), or NULL (chain) */
} segment_t;

typedef struct {
    const layer_desc *L;
    const float *q;   /* [rows, heads * D] */
    float *out;       /* [rows, heads * D] */
    const segment_t *segments;
    const int *segment_of; /* [rows] */
} batch_attention_args;

static void batch_attention_task(void *raw, int chunk) { /* chunk: one (row, head) of the pass */
    const batch_attention_args *b = (const batch_attention_args *)raw;
    int heads = b->L->heads, row = chunk / heads, head = chunk % heads;
    const segment_t *sg = &b->segments[b->segment_of[row]];
    int D = b->L->head_dim;
    /* the segment's own view: its queries and outputs start at its first row */
    attention_args a = {b->L, b->q + (size_t)sg->row0 * heads * D, sg->keys, sg->values, sg->cap, sg->start, sg->n,
                        sg->attends, b->out + (size_t)sg->row0 * heads * D, sg->full && sg->attends != NULL};
    int local = row - sg->row0;
    int keys = a.start + a.n;
    char *mem = scratch_get(&scratch_scores, (size_t)keys * 8 + 64);
    float *scores = (float *)mem;
    int *slots = (int *)(mem + (size_t)keys * 4);
#if QE_X86
    if (!force_portable && have_avx512bf16()) {
        int count = visible_slots(&a, local, slots);
        if (attend_avx512(&a, local, head, scores, slots, count)) return;
    } else if (!force_portable && have_avx2()) {
        int count = visible_slots(&a, local, slots);
        if (attend_avx2(&a, local, head, scores, slots, count)) return;
    }
#endif
    attend_one(&a, local, head, scores, slots);
}

static void attention_task(void *raw, int chunk) { /* chunk: one (row, head) */
    const attention_args *a = (const attention_args *)raw;
    int heads = a->L->heads, row = chunk / heads, head = chunk % heads;
    int keys = a->start + a->n;
    char *mem = scratch_get(&scratch_scores, (size_t)keys * 8 + 64);
    float *scores = (float *)mem;
    int *slots = (int *)(mem + (size_t)keys * 4);
#if QE_X86
    if (!force_portable && have_avx512bf16()) {
        int count = visible_slots(a, row, slots);
        if (attend_avx512(a, row, head, scores, slots, count)) return;
    } else if (!force_portable && have_avx2()) {
        int count = visible_slots(a, row, slots);
        if (attend_avx2(a, row, head, scores, slots, count)) return;
    }
#endif
    attend_one(a, row, head, scores, slots);
}

typedef struct {
    const float *gu; /* [n, 2I] */
    float *act;      /* [n, I] */
    int n, inter;
} swiglu_args;

static void swiglu_task(void *raw, int chunk) { /* chunk: one row */
    const swiglu_args *a = (const swiglu_args *)raw;
    for (int r = chunk; r < chunk + 1; r++) {
        const float *g = a->gu + (size_t)r * 2 * a->inter, *u = g + a->inter;
        float *o = a->act + (size_t)r * a->inter;
        /* silu(g) * u = g / (1 + exp(-g)) * u */
        for (int i = 0; i < a->inter; i++) o[i] = -g[i];
        exp_inplace(o, a->inter);
        for (int i = 0; i < a->inter; i++) o[i] = g[i] / (1.0f + o[i]) * u[i];
    }
}

/* One decoder layer over hidden [n, H] (float32): out = h + attention unit (if flags & 1), then
 * + MLP unit (if flags & 2). New keys/values go to slots start .. start+n-1 of the layer's cache
 * [kv_heads, cap, D]; cos/signed_sin [n, D] rotate by position (x*cos + roll(x, D/2)*signed_sin). */
static void run_layer(const layer_desc *L, const float *h_in, float *h, int n, int start, float *keys, float *values,
                      int cap, const float *cos, const float *ssin, const uint8_t *attends, int flags, int nth) {
    int H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter;
    int qkv_width = (heads + 2 * kvh) * D;
    size_t need = (size_t)n * (H + qkv_width + heads * D + 2 * I + I) * 4 + 5 * 64;
    char *mem = scratch_get(&scratch_main, need);
    float *xn = (float *)mem;
    float *qkv = xn + (size_t)n * H;
    float *att = qkv + (size_t)n * qkv_width;
    float *gu = att + (size_t)n * heads * D;
    float *act = gu + (size_t)n * 2 * I;
    if (h != h_in) memcpy(h, h_in, (size_t)n * H * 4);
    if (flags & 1) {
        for (int r = 0; r < n; r++) rms_norm(h + (size_t)r * H, L->norm_in, L->eps, H, xn + (size_t)r * H);
        linear(&L->qkv, L->round_bf16, xn, n, qkv, qkv_width, 0, nth);
        int half = D / 2;
        for (int r = 0; r < n; r++) {
            float *row = qkv + (size_t)r * qkv_width;
            const float *c = cos + (size_t)r * D, *s = ssin + (size_t)r * D;
            float tmp[512];
            for (int hh = 0; hh < heads + kvh; hh++) { /* q heads and k heads rotate; v does not */
                float *x = row + (size_t)hh * D;
                for (int i = 0; i < D; i++) tmp[i] = x[i] * c[i] + x[(i + half) % D] * s[i];
                memcpy(x, tmp, (size_t)D * 4);
            }
            for (int g = 0; g < kvh; g++) {
                memcpy(keys + ((size_t)g * cap + start + r) * D, row + (size_t)(heads + g) * D, (size_t)D * 4);
                memcpy(values + ((size_t)g * cap + start + r) * D, row + (size_t)(heads + kvh + g) * D, (size_t)D * 4);
            }
        }
        /* queries packed [n, heads*D] for the attention (in place: the q part of each row) */
        float *q = att; /* borrow: att is written per (row, head) from q, so give q its own copy first */
        float *qcopy = gu; /* gu is free until the MLP */
        for (int r = 0; r < n; r++) memcpy(qcopy + (size_t)r * heads * D, qkv + (size_t)r * qkv_width, (size_t)heads * D * 4);
        attention_args aa = {L, qcopy, keys, values, cap, start, n, attends, q, (flags & 4) && attends != NULL};
        int anth = (int64_t)n * heads * (start + n) < 1024 ? 1 : nth; /* a few microseconds: one thread */
        int64_t attention_started = profiling ? now_ns() : 0;
        run_parallel(attention_task, &aa, n * heads, anth);
        if (profiling) profile_ns[2] += now_ns() - attention_started;
        linear(&L->o, L->round_bf16, att, n, h, H, 1, nth);
    }
    if (flags & 2) {
        for (int r = 0; r < n; r++) rms_norm(h + (size_t)r * H, L->norm_post, L->eps, H, xn + (size_t)r * H);
        linear(&L->gate_up, L->round_bf16, xn, n, gu, 2 * I, 0, nth);
        swiglu_args sa = {gu, act, n, I};
        run_parallel(swiglu_task, &sa, n, n >= 8 ? nth : 1);
        linear(&L->down, L->round_bf16, act, n, h, H, 1, nth);
    }
}

/* One decoder layer over the rows of several sequences (``segments``, rows in segment order): the
 * products over all rows at once, each sequence's keys/values written to its own cache and its
 * attention over its own cache. A row's results are what its sequence's own pass gives: the
 * products are row-independent and the attention reads only the row's sequence. */
static void run_layer_batch(const layer_desc *L, const float *h_in, float *h, int rows, const segment_t *segments,
                            int count, const int *segment_of, const float *cos, const float *ssin, int flags, int nth) {
    int H = L->hidden, D = L->head_dim, heads = L->heads, kvh = L->kv_heads, I = L->inter;
    int qkv_width = (heads + 2 * kvh) * D;
    size_t need = (size_t)rows * (H + qkv_width + heads * D + 2 * I + I) * 4 + 5 * 64;
    char *mem = scratch_get(&scratch_main, need);
    float *xn = (float *)mem;
    float *qkv = xn + (size_t)rows * H;
    float *att = qkv + (size_t)rows * qkv_width;
    float *gu = att + (size_t)rows * heads * D;
    float *act = gu + (size_t)rows * 2 * I;
    if (h != h_in) memcpy(h, h_in, (size_t)rows * H * 4);
    if (flags & 1) {
        for (int r = 0; r < rows; r++) rms_norm(h + (size_t)r * H, L->norm_in, L->eps, H, xn + (size_t)r * H);
        linear(&L->qkv, L->round_bf16, xn, rows, qkv, qkv_width, 0, nth);
        int half = D / 2;
        for (int r = 0; r < rows; r++) {
            const segment_t *sg = &segments[segment_of[r]];
            float *row = qkv + (size_t)r * qkv_width;
            const float *c = cos + (size_t)r * D, *sn = ssin + (size_t)r * D;
            float tmp[512];
            for (int hh = 0; hh < heads + kvh; hh++) {
                float *x = row + (size_t)hh * D;
                for (int i = 0; i < D; i++) tmp[i] = x[i] * c[i] + x[(i + half) % D] * sn[i];
                memcpy(x, tmp, (size_t)D * 4);
            }
            int slot = sg->start + (r - sg->row0);
            for (int g = 0; g < kvh; g++) {
                memcpy(sg->keys + ((size_t)g * sg->cap + slot) * D, row + (size_t)(heads + g) * D, (size_t)D * 4);
                memcpy(sg->values + ((size_t)g * sg->cap + slot) * D, row + (size_t)(heads + kvh + g) * D, (size_t)D * 4);
            }
        }
        float *qcopy = gu;
        for (int r = 0; r < rows; r++) memcpy(qcopy + (size_t)r * heads * D, qkv + (size_t)r * qkv_width, (size_t)heads * D * 4);
        batch_attention_args ba = {L, qcopy, att, segments, segment_of};
        int64_t work = 0;
        for (int i = 0; i < count; i++) work += (int64_t)segments[i].n * heads * (segments[i].start + segments[i].n);
        int64_t attention_started = profiling ? now_ns() : 0;
        run_parallel(batch_attention_task, &ba, rows * heads, work < 1024 ? 1 : nth);
        if (profiling) profile_ns[2] += now_ns() - attention_started;
        linear(&L->o, L->round_bf16, att, rows, h, H, 1, nth);
    }
    if (flags & 2) {
        for (int r = 0; r < rows; r++) rms_norm(h + (size_t)r * H, L->norm_post, L->eps, H, xn + (size_t)r * H);
        linear(&L->gate_up, L->round_bf16, xn, rows, gu, 2 * I, 0, nth);
        swiglu_args sa = {gu, act, rows, I};
        run_parallel(swiglu_task, &sa, rows, rows >= 8 ? nth : 1);
        linear(&L->down, L->round_bf16, act, rows, h, H, 1, nth);
    }
}

/* ---- repacking and de-quantising ------------------------------------------------------------ */

/* GGUF rows (each K/32 blocks of ``type``) -> ``kind``'s cells in ``layout``, written as rows
 * ``row0`` .. ``row0 + N - 1`` of ``dst`` (a weight stacked from parts, e.g. q/k/v, is repacked part
 * by part, in order; each tile is cleared when its first row is written, so rows past the last one
 * are zero); output row ``row0 + n`` is source row ``order[n]`` (NULL: n). */
static void repack(int type, int layout, const uint8_t *src, const int64_t *order, int N, int K, uint8_t *dst, int row0) {
    int kind = type == GGUF_Q8_0 ? KIND_Q8 : KIND_Q4, KB = K / QK;
    size_t cb = cell_bytes(kind), bb = gguf_block_bytes(type);
    for (int n = 0; n < N; n++) {
        int t = (row0 + n) / TILE, r = (row0 + n) % TILE;
        const uint8_t *from = src + (size_t)(order ? order[n] : n) * KB * bb;
        if (r == 0) memset(dst + (size_t)t * KB * cb, 0, (size_t)KB * cb); /* a tile is cleared at its first row */
        for (int b = 0; b < KB; b++) {
            uint16_t d, m;
            int q[QK];
            read_gguf_block(type, from + (size_t)b * bb, &d, &m, q);
            uint8_t *cell = dst + ((size_t)t * KB + b) * cb;
            memcpy(cell + 2 * r, &d, 2);
            if (kind == KIND_Q4) {
                memcpy(cell + 32 + 2 * r, &m, 2);
                for (int k = 0; k < QK; k++) {
                    int byte, shift;
                    q4_slot(layout, r, k, &byte, &shift);
                    cell[64 + byte] |= (uint8_t)(q[k] << shift);
                }
            } else {
                for (int k = 0; k < QK; k++) cell[32 + q8_slot(layout, r, k)] = q8_store(layout, q[k]);
            }
        }
    }
}

/* Rows ``rows`` of a repacked weight as float32 [count, K]: d*q + m exactly (one rounding). */
static void dequant_rows(int kind, int layout, const uint8_t *w, int N, int K, const int64_t *rows, int count,
                         float *out) {
    int KB = K / QK;
    size_t cb = cell_bytes(kind);
    for (int c = 0; c < count; c++) {
        int64_t n = rows[c];
        int t = (int)(n / TILE), r = (int)(n % TILE);
        for (int b = 0; b < KB; b++) {
            const uint8_t *cell = w + ((size_t)t * KB + b) * cb;
            uint16_t h;
            memcpy(&h, cell + 2 * r, 2);
            float d = fp16_to_float(h), m = 0.0f;
            if (kind == KIND_Q4) {
                memcpy(&h, cell + 32 + 2 * r, 2);
                m = fp16_to_float(h);
            }
            for (int k = 0; k < QK; k++) {
                int v;
                if (kind == KIND_Q4) {
                    int byte, shift;
                    q4_slot(layout, r, k, &byte, &shift);
                    v = (cell[64 + byte] >> shift) & 0x0f;
                } else {
                    v = q8_load(layout, cell[32 + q8_slot(layout, r, k)]);
                }
                out[(size_t)c * K + b * QK + k] = fmaf(d, (float)v, m);
            }
        }
    }
    (void)N;
}

/* Rows ``rows`` of a repacked weight as a new repacked weight of ``count`` rows (the same values):
 * the draft head's vocabulary, a subset of the target's LM head. */
static void gather_rows(int kind, int layout, const uint8_t *w, int K, const int64_t *rows, int count, uint8_t *dst) {
    int KB = K / QK, tiles = (count + TILE - 1) / TILE;
    size_t cb = cell_bytes(kind);
    memset(dst, 0, (size_t)tiles * KB * cb);
    for (int c = 0; c < count; c++) {
        int64_t n = rows[c];
        int st = (int)(n / TILE), sr = (int)(n % TILE), dt = c / TILE, dr = c % TILE;
        for (int b = 0; b < KB; b++) {
            const uint8_t *from = w + ((size_t)st * KB + b) * cb;
            uint8_t *to = dst + ((size_t)dt * KB + b) * cb;
            memcpy(to + 2 * dr, from + 2 * sr, 2);
            if (kind == KIND_Q4) memcpy(to + 32 + 2 * dr, from + 32 + 2 * sr, 2);
            for (int k = 0; k < QK; k++) {
                if (kind == KIND_Q4) {
                    int sb, ss, db, ds;
                    q4_slot(layout, sr, k, &sb, &ss);
                    q4_slot(layout, dr, k, &db, &ds);
                    to[64 + db] |= (uint8_t)(((from[64 + sb] >> ss) & 0x0f) << ds);
                } else {
                    to[32 + q8_slot(layout, dr, k)] = from[32 + q8_slot(layout, sr, k)];
                }
            }
        }
    }
}

/* ---- Python bindings ------------------------------------------------------------------------ */

static int as_ptr(PyObject *o, void **p) {
    *p = PyLong_AsVoidPtr(o);
    return !(*p == NULL && PyErr_Occurred());
}

static int as_int(PyObject *o, long long *v) {
    *v = PyLong_AsLongLong(o);
    return !(*v == -1 && PyErr_Occurred());
}

#define ARGS(count)                                                                         \
    if (nargs != (count)) {                                                                 \
        PyErr_Format(PyExc_TypeError, "expected %d arguments, got %zd", (int)(count), nargs); \
        return NULL;                                                                        \
    }

static PyObject *py_isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (force_portable) return PyUnicode_FromString("portable");
    if (have_avx512bf16()) return PyUnicode_FromString("avx512bf16");
    if (have_avx2()) return PyUnicode_FromString("avx2");
    return PyUnicode_FromString("portable");
}

static PyObject *py_force_portable(PyObject *self, PyObject *arg) {
    (void)self;
    force_portable = PyObject_IsTrue(arg);
    Py_RETURN_NONE;
}

static PyObject *py_packed_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(3);
    long long type, n, k;
    if (!as_int(args[0], &type) || !as_int(args[1], &n) || !as_int(args[2], &k)) return NULL;
    int kind = type == GGUF_Q8_0 ? KIND_Q8 : KIND_Q4;
    return PyLong_FromSize_t((size_t)((n + TILE - 1) / TILE) * (size_t)(k / QK) * cell_bytes(kind));
}

/* repack(type, layout, src, order or None, N, K, dst, row0): see repack() */
static PyObject *py_repack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(8);
    long long type, layout, n, k, row0;
    void *src, *dst, *order = NULL;
    if (!as_int(args[0], &type) || !as_int(args[1], &layout) || !as_ptr(args[2], &src) || !as_int(args[4], &n) ||
        !as_int(args[5], &k) || !as_ptr(args[6], &dst) || !as_int(args[7], &row0))
        return NULL;
    if (args[3] != Py_None && !as_ptr(args[3], &order)) return NULL;
    if (type != GGUF_Q4_0 && type != GGUF_Q4_1 && type != GGUF_Q8_0) {
        PyErr_Format(PyExc_ValueError, "ggml type %lld is not native here", type);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    repack((int)type, (int)layout, src, order, (int)n, (int)k, dst, (int)row0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* dequant_rows(kind, layout, w, N, K, rows_ptr, count, out) */
static PyObject *py_dequant_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(8);
    long long kind, layout, n, k, count;
    void *w, *rows, *out;
    if (!as_int(args[0], &kind) || !as_int(args[1], &layout) || !as_ptr(args[2], &w) || !as_int(args[3], &n) ||
        !as_int(args[4], &k) || !as_ptr(args[5], &rows) || !as_int(args[6], &count) || !as_ptr(args[7], &out))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    dequant_rows((int)kind, (int)layout, w, (int)n, (int)k, rows, (int)count, out);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gather_rows(kind, layout, w, K, rows_ptr, count, dst) */
static PyObject *py_gather_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(7);
    long long kind, layout, k, count;
    void *w, *rows, *dst;
    if (!as_int(args[0], &kind) || !as_int(args[1], &layout) || !as_ptr(args[2], &w) || !as_int(args[3], &k) ||
        !as_ptr(args[4], &rows) || !as_int(args[5], &count) || !as_ptr(args[6], &dst))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    gather_rows((int)kind, (int)layout, w, (int)k, rows, (int)count, dst);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* matmul(kind, layout, w, N, K, round_bf16, x, M, out, ldo, accumulate, threads) */
static PyObject *py_matmul(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(12);
    long long kind, layout, n, k, rnd, m, ldo, acc, nth;
    void *w, *x, *out;
    if (!as_int(args[0], &kind) || !as_int(args[1], &layout) || !as_ptr(args[2], &w) || !as_int(args[3], &n) ||
        !as_int(args[4], &k) || !as_int(args[5], &rnd) || !as_ptr(args[6], &x) || !as_int(args[7], &m) ||
        !as_ptr(args[8], &out) || !as_int(args[9], &ldo) || !as_int(args[10], &acc) || !as_int(args[11], &nth))
        return NULL;
    qweight q = {(int)kind, (int)layout, w, (int)n, (int)k};
    Py_BEGIN_ALLOW_THREADS
    unsigned csr = flush_denormals();
    linear(&q, (int)rnd, x, (int)m, out, (int)ldo, (int)acc, (int)nth);
    restore_denormals(csr);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void layer_capsule_free(PyObject *capsule) { free(PyCapsule_GetPointer(capsule, "tierspec.layer")); }

/* make_layer(layout, round_bf16, (kind, w, N, K) x 4 = qkv, o, gate_up, down, norm_in, norm_post, eps,
 *            hidden, heads, kv_heads, head_dim, inter) */
static PyObject *py_make_layer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(2 + 16 + 3 + 5);
    long long layout, rnd;
    if (!as_int(args[0], &layout) || !as_int(args[1], &rnd)) return NULL;
    layer_desc *L = calloc(1, sizeof(layer_desc));
    if (!L) return PyErr_NoMemory();
    qweight *ws[4] = {&L->qkv, &L->o, &L->gate_up, &L->down};
    for (int i = 0; i < 4; i++) {
        long long kind, n, k;
        void *w;
        if (!as_int(args[2 + 4 * i], &kind) || !as_ptr(args[3 + 4 * i], &w) || !as_int(args[4 + 4 * i], &n) ||
            !as_int(args[5 + 4 * i], &k)) {
            free(L);
            return NULL;
        }
        *ws[i] = (qweight){(int)kind, (int)layout, w, (int)n, (int)k};
    }
    void *ni, *np;
    long long dims[5];
    double eps = PyFloat_AsDouble(args[20]);
    if (!as_ptr(args[18], &ni) || !as_ptr(args[19], &np) || (eps == -1.0 && PyErr_Occurred())) {
        free(L);
        return NULL;
    }
    for (int i = 0; i < 5; i++)
        if (!as_int(args[21 + i], &dims[i])) {
            free(L);
            return NULL;
        }
    L->norm_in = ni;
    L->norm_post = np;
    L->eps = (float)eps;
    L->hidden = (int)dims[0];
    L->heads = (int)dims[1];
    L->kv_heads = (int)dims[2];
    L->head_dim = (int)dims[3];
    L->inter = (int)dims[4];
    L->round_bf16 = (int)rnd;
    if (L->head_dim > 512 || L->heads % L->kv_heads) {
        free(L);
        PyErr_SetString(PyExc_ValueError, "head_dim above 512 or heads not a multiple of kv_heads");
        return NULL;
    }
    return PyCapsule_New(L, "tierspec.layer", layer_capsule_free);
}

/* run_layer(layer, h_in, h_out, n, start, keys, values, cap, cos, signed_sin, attends, flags, threads) */
static PyObject *py_run_layer(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(13);
    layer_desc *L = PyCapsule_GetPointer(args[0], "tierspec.layer");
    if (!L) return NULL;
    void *hin, *h, *keys, *values, *cos, *sin, *attends;
    long long n, start, cap, flags, nth;
    if (!as_ptr(args[1], &hin) || !as_ptr(args[2], &h) || !as_int(args[3], &n) || !as_int(args[4], &start) ||
        !as_ptr(args[5], &keys) || !as_ptr(args[6], &values) || !as_int(args[7], &cap) || !as_ptr(args[8], &cos) ||
        !as_ptr(args[9], &sin) || !as_int(args[11], &flags) || !as_int(args[12], &nth))
        return NULL;
    attends = args[10] == Py_None ? NULL : PyLong_AsVoidPtr(args[10]);
    if (PyErr_Occurred()) return NULL;
    if (start + n > cap) {
        PyErr_Format(PyExc_ValueError, "a pass of %lld tokens at %lld does not fit a cache of %lld slots", n, start, cap);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    int64_t started = profiling ? now_ns() : 0;
    unsigned csr = flush_denormals();
    run_layer(L, hin, h, (int)n, (int)start, keys, values, (int)cap, cos, sin, attends, (int)flags, (int)nth);
    restore_denormals(csr);
    if (profiling) {
        profile_ns[0] += now_ns() - started;
        profile_ns[3] += 1;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* profile(on) -> (layer seconds, matrix seconds, attention seconds, layer calls) since the last call */
static PyObject *py_profile(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *out = Py_BuildValue("(dddL)", profile_ns[0] * 1e-9, profile_ns[1] * 1e-9, profile_ns[2] * 1e-9,
                                  (long long)profile_ns[3]);
    memset(profile_ns, 0, sizeof profile_ns);
    profiling = PyObject_IsTrue(arg);
    return out;
}

typedef struct {
    int count;
    layer_desc **layers;
    PyObject *keep; /* the tuple of layer capsules */
} stack_desc;

static void stack_capsule_free(PyObject *capsule) {
    stack_desc *S = PyCapsule_GetPointer(capsule, "tierspec.stack");
    if (!S) return;
    Py_XDECREF(S->keep);
    free(S->layers);
    free(S);
}

/* make_stack(tuple of layer capsules): the decoder's layers, run in one call by run_stack */
static PyObject *py_make_stack(PyObject *self, PyObject *layers) {
    (void)self;
    if (!PyTuple_Check(layers)) {
        PyErr_SetString(PyExc_TypeError, "make_stack takes a tuple of layers");
        return NULL;
    }
    Py_ssize_t count = PyTuple_GET_SIZE(layers);
    stack_desc *S = calloc(1, sizeof(stack_desc));
    if (!S) return PyErr_NoMemory();
    S->layers = calloc(count ? (size_t)count : 1, sizeof(layer_desc *));
    if (!S->layers) {
        free(S);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        S->layers[i] = PyCapsule_GetPointer(PyTuple_GET_ITEM(layers, i), "tierspec.layer");
        if (!S->layers[i]) {
            free(S->layers);
            free(S);
            return NULL;
        }
    }
    S->count = (int)count;
    Py_INCREF(layers);
    S->keep = layers;
    return PyCapsule_New(S, "tierspec.stack", stack_capsule_free);
}

/* run_stack(stack, first, last, h_in, h_out, n, start, table, cos, signed_sin, attends, flags, threads):
 * layers first .. last-1 in turn over the rows (h_out = the last one's output); table: int64
 * [count, 3] of (keys, values, capacity) per layer; flags: bytes, one per layer (as run_layer's). */
static PyObject *py_run_stack(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(13);
    stack_desc *S = PyCapsule_GetPointer(args[0], "tierspec.stack");
    if (!S) return NULL;
    long long first, last, n, start, nth;
    void *hin, *h, *table, *cos, *sin, *attends;
    if (!as_int(args[1], &first) || !as_int(args[2], &last) || !as_ptr(args[3], &hin) || !as_ptr(args[4], &h) ||
        !as_int(args[5], &n) || !as_int(args[6], &start) || !as_ptr(args[7], &table) || !as_ptr(args[8], &cos) ||
        !as_ptr(args[9], &sin) || !as_int(args[12], &nth))
        return NULL;
    attends = args[10] == Py_None ? NULL : PyLong_AsVoidPtr(args[10]);
    if (PyErr_Occurred()) return NULL;
    if (!PyBytes_Check(args[11]) || PyBytes_GET_SIZE(args[11]) != S->count) {
        PyErr_SetString(PyExc_ValueError, "flags must be bytes, one per layer of the stack");
        return NULL;
    }
    if (first < 0 || last > S->count || first > last) {
        PyErr_SetString(PyExc_ValueError, "layer range outside the stack");
        return NULL;
    }
    const uint8_t *flags = (const uint8_t *)PyBytes_AS_STRING(args[11]);
    const int64_t *t = table;
    for (long long i = first; i < last; i++)
        if ((flags[i] & 1) && start + n > t[3 * i + 2]) {
            PyErr_Format(PyExc_ValueError, "layer %lld's cache holds %lld slots, the pass needs %lld", i,
                         (long long)t[3 * i + 2], start + n);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    int64_t started = profiling ? now_ns() : 0;
    unsigned csr = flush_denormals();
    const void *source = hin;
    for (long long i = first; i < last; i++) {
        if (!flags[i]) continue;
        run_layer(S->layers[i], source, h, (int)n, (int)start, (float *)(intptr_t)t[3 * i], (float *)(intptr_t)t[3 * i + 1],
                  (int)t[3 * i + 2], cos, sin, attends, flags[i], (int)nth);
        source = h;
    }
    if (source != h) memcpy(h, hin, (size_t)n * S->layers[0]->hidden * 4);
    restore_denormals(csr);
    if (profiling) {
        profile_ns[0] += now_ns() - started;
        profile_ns[3] += last - first;
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* run_stack_batch(stack, first, last, h_in, h_out, rows, sequences, count, cos, signed_sin, flags, threads):
 * layers first .. last-1 over the rows of ``count`` sequences; sequences: int64 [count, 5] of (first
 * row, rows, start, the sequence's int64 [layers, 3] KV table (as run_stack's), attends or 0), the
 * attends [n, n] among the sequence's new rows. */
static PyObject *py_run_stack_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    ARGS(12);
    stack_desc *S = PyCapsule_GetPointer(args[0], "tierspec.stack");
    if (!S) return NULL;
    long long first, last, rows, count, nth;
    void *hin, *h, *seqs, *cos, *sin;
    if (!as_int(args[1], &first) || !as_int(args[2], &last) || !as_ptr(args[3], &hin) || !as_ptr(args[4], &h) ||
        !as_int(args[5], &rows) || !as_ptr(args[6], &seqs) || !as_int(args[7], &count) || !as_ptr(args[8], &cos) ||
        !as_ptr(args[9], &sin) || !as_int(args[11], &nth))
        return NULL;
    if (!PyBytes_Check(args[10]) || PyBytes_GET_SIZE(args[10]) != S->count) {
        PyErr_SetString(PyExc_ValueError, "flags must be bytes, one per layer of the stack");
        return NULL;
    }
    if (first < 0 || last > S->count || first > last || count < 1 || rows < 1) {
        PyErr_SetString(PyExc_ValueError, "layer range outside the stack, or an empty batch");
        return NULL;
    }
    const uint8_t *flags = (const uint8_t *)PyBytes_AS_STRING(args[10]);
    const int64_t *sq = seqs;
    int64_t covered = 0;
    for (long long i = 0; i < count; i++) {
        if (sq[5 * i] != covered || sq[5 * i + 1] < 1) {
            PyErr_SetString(PyExc_ValueError, "sequences must cover the rows in order, one row at least each");
            return NULL;
        }
        covered += sq[5 * i + 1];
        const int64_t *t = (const int64_t *)(intptr_t)sq[5 * i + 3];
        for (long long l = first; l < last; l++)
            if ((flags[l] & 1) && sq[5 * i + 2] + sq[5 * i + 1] > t[3 * l + 2]) {
                PyErr_Format(PyExc_ValueError, "sequence %lld's cache of layer %lld is too small", i, l);
                return NULL;
            }
    }
    if (covered != rows) {
        PyErr_SetString(PyExc_ValueError, "the sequences do not cover the pass's rows");
        return NULL;
    }
    segment_t *segments = malloc(sizeof(segment_t) * (size_t)count);
    int *segment_of = malloc(sizeof(int) * (size_t)rows);
    if (!segments || !segment_of) {
        free(segments);
        free(segment_of);
        return PyErr_NoMemory();
    }
    for (long long i = 0; i < count; i++)
        for (long long r = sq[5 * i]; r < sq[5 * i] + sq[5 * i + 1]; r++) segment_of[r] = (int)i;
    Py_BEGIN_ALLOW_THREADS
    int64_t started = profiling ? now_ns() : 0;
    unsigned csr = flush_denormals();
    const void *source = hin;
    for (long long l = first; l < last; l++) {
        if (!flags[l]) continue;
        for (long long i = 0; i < count; i++) {
            const int64_t *t = (const int64_t *)(intptr_t)sq[5 * i + 3];
            segments[i] = (segment_t){(int)sq[5 * i], (int)sq[5 * i + 1], (int)sq[5 * i + 2], (int)t[3 * l + 2], 0,
                                      (float *)(intptr_t)t[3 * l], (float *)(intptr_t)t[3 * l + 1],
                                      (const uint8_t *)(intptr_t)sq[5 * i + 4]};
        }
        run_layer_batch(S->layers[l], source, h, (int)rows, segments, (int)count, segment_of, cos, sin, flags[l], (int)nth);
        source = h;
    }
    if (source != h) memcpy(h, hin, (size_t)rows * S->layers[0]->hidden * 4);
    restore_denormals(csr);
    if (profiling) {
        profile_ns[0] += now_ns() - started;
        profile_ns[3] += last - first;
    }
    Py_END_ALLOW_THREADS
    free(segments);
    free(segment_of);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run_stack_batch", (PyCFunction)(void (*)(void))py_run_stack_batch, METH_FASTCALL,
     "Layers first..last-1 over the rows of several sequences, each with its own cache."},
    {"make_stack", py_make_stack, METH_O, "The decoder's layers as one description (for run_stack)."},
    {"run_stack", (PyCFunction)(void (*)(void))py_run_stack, METH_FASTCALL, "Layers first..last-1 in one call."},
    {"profile", py_profile, METH_O, "Time spent in layer calls, their products and attention (and switch it on/off)."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels use here: avx512bf16, avx2 or portable."},
    {"force_portable", py_force_portable, METH_O, "Use the portable C loops whatever the CPU (tests)."},
    {"packed_bytes", (PyCFunction)(void (*)(void))py_packed_bytes, METH_FASTCALL, "Bytes of a repacked weight."},
    {"repack", (PyCFunction)(void (*)(void))py_repack, METH_FASTCALL, "GGUF blocks -> the kernels' layout."},
    {"dequant_rows", (PyCFunction)(void (*)(void))py_dequant_rows, METH_FASTCALL, "Rows of a repacked weight as float32."},
    {"gather_rows", (PyCFunction)(void (*)(void))py_gather_rows, METH_FASTCALL, "Rows of a repacked weight, repacked."},
    {"matmul", (PyCFunction)(void (*)(void))py_matmul, METH_FASTCALL, "out (+)= x W^T with a repacked weight."},
    {"make_layer", (PyCFunction)(void (*)(void))py_make_layer, METH_FASTCALL, "A decoder layer's description."},
    {"run_layer", (PyCFunction)(void (*)(void))py_run_layer, METH_FASTCALL, "One decoder layer over a pass's rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_qengine", "tierspec's pass engine (see qengine.c).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__qengine(void) {
    detect_cpu();
    return PyModule_Create(&module);
}
