/*
 * gdn_cpu_common.c — the CPU backend's shared helpers (declared in gdn_cpu.h):
 * a pthreads parallel-for, dtype row conversions, the L2 norm.
 */
#include "gdn_cpu.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

/* ------------------------------------------------------- parallel-for ---- */

typedef struct {
    void (*fn)(void *ctx, int64_t item, int thread_id);
    void *ctx;
    int64_t n_items;
    atomic_llong next; /* the next item not yet handed out */
} fq_pfor_shared;

typedef struct {
    fq_pfor_shared *shared;
    int thread_id;
} fq_pfor_worker;

static void pfor_run(fq_pfor_shared *s, int thread_id)
{
    for (;;) {
        long long item = atomic_fetch_add_explicit(&s->next, 1, memory_order_relaxed);
        if (item >= s->n_items) break;
        s->fn(s->ctx, (int64_t)item, thread_id);
    }
}

static void *pfor_thread_main(void *arg)
{
    fq_pfor_worker *w = (fq_pfor_worker *)arg;
    pfor_run(w->shared, w->thread_id);
    return NULL;
}

int fq_cpu_resolve_threads(int64_t n_items, int num_threads)
{
    int nt = num_threads > 0 ? num_threads : fq_cpu_default_threads();
    if (n_items < nt) nt = (int)n_items;
    return nt < 1 ? 1 : nt;
}

fq_status fq_cpu_parallel_for(int64_t n_items, int num_threads,
                              void (*fn)(void *ctx, int64_t item, int thread_id), void *ctx)
{
    if (n_items <= 0) return FQ_OK;
    int nt = fq_cpu_resolve_threads(n_items, num_threads);
    fq_pfor_shared s;
    s.fn = fn;
    s.ctx = ctx;
    s.n_items = n_items;
    atomic_init(&s.next, 0);
    if (nt == 1) {
        pfor_run(&s, 0);
        return FQ_OK;
    }

    pthread_t *threads = malloc((size_t)nt * sizeof *threads);
    fq_pfor_worker *workers = malloc((size_t)nt * sizeof *workers);
    int started = 0;
    if (threads && workers) {
        /* thread ids 1..nt-1 on new threads; id 0 is the caller */
        for (int i = 1; i < nt; i++) {
            workers[i].shared = &s;
            workers[i].thread_id = i;
            if (pthread_create(&threads[i], NULL, pfor_thread_main, &workers[i]) != 0) break;
            started = i;
        }
    }
    pfor_run(&s, 0); /* the caller works too and picks up what others could not */
    for (int i = 1; i <= started; i++) pthread_join(threads[i], NULL);
    free(threads);
    free(workers);
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define FQ_GEMM_MR 8  /* rows of C per micro-kernel call    */
#define FQ_GEMM_NR 32 /* columns of C per micro-kernel call */

/* Edge tile (and the portable path): C[mr x nr] = cscale*C + A.B over kc. */
static void gemm_tile_f32_generic(int64_t mr, int64_t nr, int64_t kc, const float *restrict A,
                                  int64_t lda, const float *restrict B, int64_t ldb,
                                  float *restrict C, int64_t ldc, float cscale, int load_c)
{
    for (int64_t i = 0; i < mr; i++) {
        float *restrict c = C + i * ldc;
        if (load_c)
            for (int64_t j = 0; j < nr; j++) c[j] *= cscale;
        else
            for (int64_t j = 0; j < nr; j++) c[j] = 0.0f;
        for (int64_t p = 0; p < kc; p++) {
            float a = A[i * lda + p];
            const float *restrict b = B + p * ldb;
            for (int64_t j = 0; j < nr; j++) c[j] += a * b[j];
        }
    }
}

#if defined(__AVX512F__)
/* The 8 x 32 micro-kernel: 16 zmm accumulators; per k step two loads of B's
 * row and eight broadcasts of A's column feed 16 FMAs. */
static void gemm_tile_f32_8x32(int64_t kc, const float *restrict A, int64_t lda,
                               const float *restrict B, int64_t ldb, float *restrict C,
                               int64_t ldc, float cscale, int load_c)
{
    __m512 c0[FQ_GEMM_MR], c1[FQ_GEMM_MR];
    if (load_c) {
        __m512 s = _mm512_set1_ps(cscale);
#pragma GCC unroll 8
        for (int i = 0; i < FQ_GEMM_MR; i++) {
            c0[i] = _mm512_mul_ps(s, _mm512_loadu_ps(C + i * ldc));
            c1[i] = _mm512_mul_ps(s, _mm512_loadu_ps(C + i * ldc + 16));
        }
    } else {
#pragma GCC unroll 8
        for (int i = 0; i < FQ_GEMM_MR; i++) c0[i] = c1[i] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kc; p++) {
        __m512 b0 = _mm512_loadu_ps(B + p * ldb), b1 = _mm512_loadu_ps(B + p * ldb + 16);
#pragma GCC unroll 8
        for (int i = 0; i < FQ_GEMM_MR; i++) {
            __m512 a = _mm512_set1_ps(A[i * lda + p]);
            c0[i] = _mm512_fmadd_ps(a, b0, c0[i]);
            c1[i] = _mm512_fmadd_ps(a, b1, c1[i]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < FQ_GEMM_MR; i++) {
        _mm512_storeu_ps(C + i * ldc, c0[i]);
        _mm512_storeu_ps(C + i * ldc + 16, c1[i]);
    }
}
#endif

void fq_cpu_gemm_f32(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda,
                     const float *B, int64_t ldb, float *C, int64_t ldc, float cscale,
                     int load_c, int tri)
{
    /* column tiles outermost: B's k x 32 panel stays in L1 across row tiles */
    for (int64_t j0 = 0; j0 < n; j0 += FQ_GEMM_NR) {
        int64_t nr = n - j0 < FQ_GEMM_NR ? n - j0 : FQ_GEMM_NR;
        for (int64_t i0 = 0; i0 < m; i0 += FQ_GEMM_MR) {
            int64_t mr = m - i0 < FQ_GEMM_MR ? m - i0 : FQ_GEMM_MR;
            int64_t last_row = i0 + mr - 1;
            if (tri == FQ_TRI_N && j0 > last_row) continue;
            int64_t kc = k;
            const float *a = A + i0 * lda;
            const float *b = B + j0;
            float *c = C + i0 * ldc + j0;
#if defined(__AVX512F__)
            if (mr == FQ_GEMM_MR && nr == FQ_GEMM_NR) {
                gemm_tile_f32_8x32(kc, a, lda, b, ldb, c, ldc, cscale, load_c);
                continue;
            }
#endif
            gemm_tile_f32_generic(mr, nr, kc, a, lda, b, ldb, c, ldc, cscale, load_c);
        }
    }
}

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
