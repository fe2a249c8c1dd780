/* The thread pool, the denormal setting of the engine's threads, scratch memory and profile clocks.
 *
 * A task is ``chunks`` independent pieces of work (tiles of a product, (row, head) pairs of the
 * attention, rows of the SwiGLU), claimed one at a time from a shared counter by the calling thread
 * and any worker that is awake. So a worker that the OS has not scheduled (a busy machine) delays
 * nothing: the caller takes the pieces it would have taken. Which thread computes a piece does not
 * change its result (each output is computed whole by one thread). */
#define _GNU_SOURCE /* clock_gettime, pthread_attr_* */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "engine.h"

#if QE_X86
#include <immintrin.h>
#endif

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
unsigned flush_denormals(void) {
#if QE_X86
    unsigned previous = _mm_getcsr();
    _mm_setcsr(previous | 0x8040); /* FTZ | DAZ */
    return previous;
#else
    return 0;
#endif
}

void restore_denormals(unsigned previous) {
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

/* A pool already running a task (another Python thread's pass) is not shared: the caller runs the
 * chunks alone. */
void run_parallel(task_fn fn, void *arg, int chunks, int nth) {
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

void *scratch_get(scratch_t *s, size_t bytes) {
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

int profiling = 0;
int64_t profile_ns[6];

int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
