/*
 * gdn_cpu_common.c — the CPU backend's shared helpers (declared in gdn_cpu.h):
 * a parallel-for on a persistent pthreads pool, dtype row conversions, the
 * L2 norm, the GEMM entry points (float: the active kernel set's; double:
 * portable loops).
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include "gdn_cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* ------------------------------------------------------- parallel-for ---- */

/* One job at a time runs on the pool. The caller publishes it (under
 * park_mu: the job, its thread count, a new generation), works on it as
 * thread 0, then closes it (under park_mu: no worker can join any more) and
 * waits only for the workers that joined while it was open. A worker joins
 * (under park_mu, counted in `active`) when it sees the new generation with
 * the job still open and its id below the job's thread count, takes items
 * from the job's counter, and leaves. So a worker that wakes late (asleep, or
 * its core busy with another process) costs the call nothing: the caller has
 * done its items. Workers 1..n_workers wait for a new generation, spinning
 * for FQ_POOL_SPIN_NS after a job they worked on (back-to-back calls find
 * them awake), then on park_cv. Everything here is static: a worker never
 * touches freed memory, and workers are never joined (they end with the
 * process). */
#define FQ_POOL_SPIN_NS 50000

typedef struct {
    void (*fn)(void *ctx, int64_t item, int thread_id);
    void *ctx;
    int64_t n_items, chunk; /* items are handed out `chunk` at a time */
    atomic_llong next;      /* the next item not yet handed out */
} fq_pfor_job;

static struct {
    pthread_mutex_t lock;    /* held by a caller for the whole of its job */
    pthread_mutex_t park_mu; /* guards job, job_nt, active's joins; with park_cv, done_cv */
    pthread_cond_t park_cv;  /* workers wait for a new generation */
    pthread_cond_t done_cv;  /* the caller waits for active == 0 */
    fq_pfor_job *job;        /* the open job (the caller's stack), NULL once closed */
    int job_nt;              /* threads on it, the caller (thread 0) included */
    int n_workers;           /* workers created so far: ids 1..n_workers */
    atomic_uint generation;  /* bumped once per job */
    atomic_int active;       /* workers that joined the current job and have not left */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER,
          PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0, 0};

static _Thread_local int pool_thread_id; /* > 0 on a pool worker */
static pthread_once_t pool_atfork_once = PTHREAD_ONCE_INIT;

static void pfor_run(fq_pfor_job *j, int thread_id)
{
    for (;;) {
        const int64_t i0 = (int64_t)atomic_fetch_add_explicit(&j->next, j->chunk, memory_order_relaxed);
        if (i0 >= j->n_items) break;
        const int64_t i1 = i0 + j->chunk < j->n_items ? i0 + j->chunk : j->n_items;
        for (int64_t item = i0; item < i1; item++) j->fn(j->ctx, item, thread_id);
    }
}

static int64_t pool_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void pool_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spins up to FQ_POOL_SPIN_NS until *a != v (1) or gives up (0). */
static int pool_spin_while_equal_uint(atomic_uint *a, unsigned v)
{
    int64_t t0 = pool_now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(a, memory_order_acquire) != v) return 1;
        pool_relax();
        if ((i & 63) == 0 && pool_now_ns() - t0 > FQ_POOL_SPIN_NS) return 0;
    }
}

static int pool_spin_while_nonzero(atomic_int *a)
{
    int64_t t0 = pool_now_ns();
    for (int i = 1;; i++) {
        if (atomic_load_explicit(a, memory_order_acquire) == 0) return 1;
        pool_relax();
        if ((i & 63) == 0 && pool_now_ns() - t0 > FQ_POOL_SPIN_NS) return 0;
    }
}

typedef struct {
    int id;
    unsigned generation; /* the generation before the job that created it */
} fq_pool_start;

static void *pool_worker_main(void *arg)
{
    const fq_pool_start start = *(const fq_pool_start *)arg;
    free(arg);
    const int id = start.id;
    unsigned seen = start.generation;
    pool_thread_id = id;
    int took_part = 1; /* spin only after a job this worker worked on */
    for (;;) {
        if (took_part) pool_spin_while_equal_uint(&pool.generation, seen);
        pthread_mutex_lock(&pool.park_mu);
        while (atomic_load_explicit(&pool.generation, memory_order_relaxed) == seen)
            pthread_cond_wait(&pool.park_cv, &pool.park_mu);
        /* generation and job are read, and the join made, under park_mu */
        seen = atomic_load_explicit(&pool.generation, memory_order_relaxed);
        fq_pfor_job *job = pool.job;
        took_part = job != NULL && id < pool.job_nt;
        if (took_part) atomic_fetch_add_explicit(&pool.active, 1, memory_order_relaxed);
        pthread_mutex_unlock(&pool.park_mu);
        if (!took_part) continue;
        pfor_run(job, id);
        /* the job is the caller's: after leaving it may be gone */
        if (atomic_fetch_sub_explicit(&pool.active, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&pool.park_mu);
            pthread_cond_signal(&pool.done_cv);
            pthread_mutex_unlock(&pool.park_mu);
        }
    }
    return NULL;
}

/* fork: the prepare handler waits for a running job (the pool is then idle
 * and consistent); the child has none of the workers, so it starts over with
 * an empty pool and fresh locks. */
static void pool_atfork_prepare(void) { pthread_mutex_lock(&pool.lock); }
static void pool_atfork_parent(void) { pthread_mutex_unlock(&pool.lock); }
static void pool_atfork_child(void)
{
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.park_mu, NULL);
    pthread_cond_init(&pool.park_cv, NULL);
    pthread_cond_init(&pool.done_cv, NULL);
    pool.job = NULL;
    pool.job_nt = 0;
    pool.n_workers = 0;
    atomic_store(&pool.active, 0);
}
static void pool_register_atfork(void)
{
    pthread_atfork(pool_atfork_prepare, pool_atfork_parent, pool_atfork_child);
}

/* Creates workers until ids 1..want-1 exist (pool.lock held); returns the
 * number of threads available, the caller included. */
static int pool_grow(int want)
{
    pthread_once(&pool_atfork_once, pool_register_atfork);
    pthread_attr_t attr;
    if (pool.n_workers + 1 < want && pthread_attr_init(&attr) == 0) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        while (pool.n_workers + 1 < want) {
            fq_pool_start *start = malloc(sizeof *start);
            if (!start) break;
            start->id = pool.n_workers + 1;
            start->generation = atomic_load_explicit(&pool.generation, memory_order_relaxed);
            pthread_t t;
            if (pthread_create(&t, &attr, pool_worker_main, start) != 0) {
                free(start);
                break;
            }
            pool.n_workers++;
        }
        pthread_attr_destroy(&attr);
    }
    return pool.n_workers + 1 < want ? pool.n_workers + 1 : want;
}

int fq_cpu_resolve_threads(int64_t n_items, int num_threads)
{
    int nt = num_threads > 0 ? num_threads : fq_cpu_default_threads();
    if (n_items < nt) nt = (int)n_items;
    return nt < 1 ? 1 : nt;
}

int fq_cpu_resolve_threads_for_bytes(int64_t n_items, int num_threads, double item_bytes)
{
    int nt = fq_cpu_resolve_threads(n_items, num_threads);
    const double per = (double)FQ_CPU_MIN_BYTES_PER_THREAD;
    const double most = (double)n_items * item_bytes / per; /* threads the work can feed */
    if (most < (double)nt) nt = most < 1.0 ? 1 : (int)most;
    return nt;
}

fq_status fq_cpu_parallel_for(int64_t n_items, int num_threads,
                              void (*fn)(void *ctx, int64_t item, int thread_id), void *ctx)
{
    return fq_cpu_parallel_for_chunked(n_items, num_threads, 1, fn, ctx);
}

fq_status fq_cpu_parallel_for_chunked(int64_t n_items, int num_threads, int64_t chunk,
                                      void (*fn)(void *ctx, int64_t item, int thread_id), void *ctx)
{
    if (n_items <= 0) return FQ_OK;
    int nt = fq_cpu_resolve_threads(n_items, num_threads);
    fq_pfor_job job;
    job.fn = fn;
    job.ctx = ctx;
    job.n_items = n_items;
    job.chunk = chunk > 1 ? chunk : 1;
    atomic_init(&job.next, 0);
    if (nt == 1 || pool_thread_id > 0) { /* one thread, or called from a pool item */
        pfor_run(&job, 0);
        return FQ_OK;
    }

    pthread_mutex_lock(&pool.lock);
    nt = pool_grow(nt);
    if (nt > 1) { /* open */
        pthread_mutex_lock(&pool.park_mu);
        pool.job = &job;
        pool.job_nt = nt;
        atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
        pthread_cond_broadcast(&pool.park_cv);
        pthread_mutex_unlock(&pool.park_mu);
    }
    pfor_run(&job, 0); /* the caller works too */
    if (nt > 1) { /* close, then wait for the workers that joined */
        pthread_mutex_lock(&pool.park_mu);
        pool.job = NULL;
        pthread_mutex_unlock(&pool.park_mu);
        if (!pool_spin_while_nonzero(&pool.active)) {
            pthread_mutex_lock(&pool.park_mu);
            while (atomic_load_explicit(&pool.active, memory_order_acquire) != 0)
                pthread_cond_wait(&pool.done_cv, &pool.park_mu);
            pthread_mutex_unlock(&pool.park_mu);
        }
    }
    pthread_mutex_unlock(&pool.lock);
    return FQ_OK;
}

/* -------------------------------------------------- dtype conversions ---- */

void fq_cpu_load_f32(float *dst, const void *base, fq_dtype dt, int64_t offset, int64_t n)
{
    switch (dt) {
    case FQ_F32: memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float)); break;
    case FQ_F16: {
        const uint16_t *s = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = fq_cpu_f16_to_f32(s[i]);
    } break;
    case FQ_BF16: {
        const uint16_t *s = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = fq_cpu_bits_to_f32((uint32_t)s[i] << 16);
    } break;
    case FQ_F64: {
        const double *s = (const double *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } break;
    }
}

void fq_cpu_load_f64(double *dst, const void *base, fq_dtype dt, int64_t offset, int64_t n)
{
    switch (dt) {
    case FQ_F32: {
        const float *s = (const float *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = s[i];
    } break;
    case FQ_F16: {
        const uint16_t *s = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = fq_cpu_f16_to_f32(s[i]);
    } break;
    case FQ_BF16: {
        const uint16_t *s = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = fq_cpu_bits_to_f32((uint32_t)s[i] << 16);
    } break;
    case FQ_F64: memcpy(dst, (const double *)base + offset, (size_t)n * sizeof(double)); break;
    }
}

void fq_cpu_store_f32(void *base, fq_dtype dt, int64_t offset, const float *src, int64_t n)
{
    switch (dt) {
    case FQ_F32: memcpy((float *)base + offset, src, (size_t)n * sizeof(float)); break;
    case FQ_F16: {
        uint16_t *d = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = fq_cpu_f32_to_f16(src[i]);
    } break;
    case FQ_BF16: {
        uint16_t *d = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = fq_cpu_f32_to_bf16(src[i]);
    } break;
    case FQ_F64: {
        double *d = (double *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = src[i];
    } break;
    }
}

/* double -> F16/BF16 goes through float (double rounding; the error is far
 * below the 16-bit ulp that matters here) */
void fq_cpu_store_f64(void *base, fq_dtype dt, int64_t offset, const double *src, int64_t n)
{
    switch (dt) {
    case FQ_F32: {
        float *d = (float *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = (float)src[i];
    } break;
    case FQ_F16: {
        uint16_t *d = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = fq_cpu_f32_to_f16((float)src[i]);
    } break;
    case FQ_BF16: {
        uint16_t *d = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) d[i] = fq_cpu_f32_to_bf16((float)src[i]);
    } break;
    case FQ_F64: memcpy((double *)base + offset, src, (size_t)n * sizeof(double)); break;
    }
}

/* ---------------------------------------------------------- L2 norm ---- */

void fq_cpu_l2norm_f32(float *x, int64_t n)
{
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss + (float)FQ_L2NORM_EPS);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
}

void fq_cpu_l2norm_f64(double *x, int64_t n)
{
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss + FQ_L2NORM_EPS);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
}

/* ------------------------------------------------------ small matmuls ---- */

/* The float product runs on the active kernel set's micro-kernel (every CPU
 * entry point has chosen it before any product runs). */
void fq_cpu_gemm_f32(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda,
                     const float *B, int64_t ldb, float *C, int64_t ldc, float cscale,
                     int load_c, int tri)
{
    const fq_cpu_kernels *kern;
    if (fq_cpu_kernels_get(&kern) != FQ_OK) kern = fq_cpu_kernels_scalar;
    kern->gemm(m, n, k, A, lda, B, ldb, C, ldc, cscale, load_c, tri);
}

/* Row and column tiles of the double product (the TRI_N bound follows them),
 * as the float kernels' largest. */
#define FQ_GEMM_MR 8
#define FQ_GEMM_NR 32

void fq_cpu_gemm_f64(int64_t m, int64_t n, int64_t k, const double *A, int64_t lda,
                     const double *B, int64_t ldb, double *C, int64_t ldc, double cscale,
                     int load_c, int tri)
{
    for (int64_t i = 0; i < m; i++) {
        int64_t i0 = i - i % FQ_GEMM_MR;
        int64_t jn = n, kc = k;
        if (tri == FQ_TRI_N) {
            int64_t last = i0 + FQ_GEMM_MR - 1;
            jn = (last / FQ_GEMM_NR + 1) * FQ_GEMM_NR;
            if (jn > n) jn = n;
        }
        double *restrict c = C + i * ldc;
        if (load_c)
            for (int64_t j = 0; j < jn; j++) c[j] *= cscale;
        else
            for (int64_t j = 0; j < jn; j++) c[j] = 0.0;
        for (int64_t p = 0; p < kc; p++) {
            double a = A[i * lda + p];
            const double *restrict b = B + p * ldb;
            for (int64_t j = 0; j < jn; j++) c[j] += a * b[j];
        }
    }
}
