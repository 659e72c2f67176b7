/*
 * gdn_cpu.h — internal helpers shared by the CPU backend files
 * (gdn_cpu_fwd.c, gdn_cpu_bwd.c, gdn_cpu_recurrent.c). Not part of the public
 * API (that is gdn.h); nothing here touches Python.
 *
 *   fq_cpu_parallel_for    pthreads parallel-for over n items (atomic counter)
 *   fq_cpu_resolve_threads how many threads a parallel-for of n items will use
 *   fq_cpu_load_f32/_f64   a row of n elements of any fq_dtype -> float/double
 *   fq_cpu_store_f32/_f64  float/double -> a row of any fq_dtype (RNE rounding)
 *   fq_cpu_seq_bounds      sequence n -> (batch row, first token, length)
 *   fq_cpu_l2norm_f32/_f64 x <- x / sqrt(sum x^2 + 1e-6)
 *   fq_cpu_index           read entry i of an int32/int64 index array
 *   fq_cpu_gemm_f32/_f64   C = cscale*C + A.B, register-blocked micro-kernel
 *   fq_cpu_trmm_*          the same for a triangular A, exactly (gdn_cpu_trmm.c)
 *   fq_cpu_gate_scan       chunk-local cumulative gate with full resets
 *   fq_cpu_expf            vectorisable float exp
 *   fq_cpu_kernels         the float kernels of one instruction set (one
 *                          gdn_cpu_kernels_<isa>.c each), fq_cpu_kernels_get
 *                          picks the set this CPU runs
 *   fq_fwd_ctx, fq_rec_ctx the work-item contexts of the forward and the
 *                          recurrent step (shared by their entry points and
 *                          the per-ISA kernel files)
 *   fq_cpu_gate_g/_beta    the gates the operator uses (fused gates applied)
 *   fq_cpu_load_state_*    a K x V state of either layout -> row-major [K][ld]
 *   fq_cpu_store_state_*   and back (gdn_cpu_state.c)
 *
 * The definitions live in gdn_cpu_common.c (thread pool, conversions, L2
 * norm, GEMM entry points) and gdn_cpu_dispatch.c (the kernel-set choice).
 * These declarations are stable: other files build on them.
 */
#ifndef FQ_GDN_CPU_H
#define FQ_GDN_CPU_H

#include "gdn.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------- parallel-for ---- */

/* Calls fn(ctx, item, thread_id) once for every item in [0, n_items), spread
 * over up to num_threads threads (<= 0: fq_cpu_default_threads()); never more
 * threads than items. Items are handed out one at a time with an atomic
 * counter; thread_id is in [0, fq_cpu_resolve_threads(n_items, num_threads))
 * so per-thread scratch can be indexed by it. With one thread (or one item)
 * everything runs inline on the calling thread.
 *
 * The other threads come from a persistent pool (gdn_cpu_common.c): created
 * at the first call that needs them, parked between calls (a short spin,
 * then a condition variable), never joined (they end with the process), and
 * re-created in a forked child (pthread_atfork). Calls from several threads
 * take the pool in turn; a call made from inside a pool item runs inline. If
 * a worker cannot be created the remaining threads (the caller included) do
 * its share: the call still completes every item and returns FQ_OK. */
fq_status fq_cpu_parallel_for(int64_t n_items, int num_threads,
                              void (*fn)(void *ctx, int64_t item, int thread_id),
                              void *ctx);

/* The same, items handed out in runs of `chunk` consecutive ones (for
 * items of equal cost: each thread then streams through contiguous memory). */
fq_status fq_cpu_parallel_for_chunked(int64_t n_items, int num_threads, int64_t chunk,
                                      void (*fn)(void *ctx, int64_t item, int thread_id),
                                      void *ctx);

/* The number of threads fq_cpu_parallel_for(n_items, num_threads, ...) uses
 * (>= 1): min(num_threads or the default, n_items), at least 1. */
int fq_cpu_resolve_threads(int64_t n_items, int num_threads);

/* The same for work whose items each touch about item_bytes of memory: no
 * more threads than leave every thread FQ_CPU_MIN_BYTES_PER_THREAD (a few
 * microseconds of work, more than waking a parked worker costs), so that a
 * small call never gets slower with more threads. */
#define FQ_CPU_MIN_BYTES_PER_THREAD (1024 * 1024)
int fq_cpu_resolve_threads_for_bytes(int64_t n_items, int num_threads, double item_bytes);

/* -------------------------------------------------- dtype conversions ---- */

static inline float fq_cpu_bits_to_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t fq_cpu_f32_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float fq_cpu_bf16_to_f32(uint16_t h) { return fq_cpu_bits_to_f32((uint32_t)h << 16); }

/* Round to nearest even; NaN stays NaN (quietened), Inf stays Inf. */
static inline uint16_t fq_cpu_f32_to_bf16(float f)
{
    uint32_t u = fq_cpu_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float fq_cpu_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) { /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        return fq_cpu_bits_to_f32(fq_cpu_f32_to_bits(f) | sign);
    }
    if (e == 31) return fq_cpu_bits_to_f32(sign | 0x7f800000u | (m << 13)); /* Inf / NaN */
    return fq_cpu_bits_to_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* Round to nearest even, overflow to Inf, subnormals kept, NaN stays NaN. */
static inline uint16_t fq_cpu_f32_to_f16(float f)
{
    uint32_t u = fq_cpu_f32_to_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) /* Inf or NaN (NaN keeps a quiet mantissa bit) */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to Inf */
    if (a < 0x38800000u) {                                    /* below 2^-14: subnormal */
        /* adding 0.5 puts the half-precision ulp 2^-24 at the float ulp of
         * 0.5, so the FPU's round-to-nearest-even does the rounding */
        float s = fq_cpu_bits_to_f32(a) + 0.5f;
        return (uint16_t)(sign | (fq_cpu_f32_to_bits(s) - 0x3f000000u));
    }
    uint32_t odd = (a >> 13) & 1u;
    a += 0xc8000fffu + odd; /* rebias exponent (-112 << 23) and round */
    return (uint16_t)(sign | (a >> 13));
}

/* Row conversions: element `offset` .. offset+n-1 of the array `base` of dtype
 * dt, to/from float or double. F64 -> float rounds; float -> F16/BF16 rounds
 * to nearest even. */
void fq_cpu_load_f32(float *dst, const void *base, fq_dtype dt, int64_t offset, int64_t n);
void fq_cpu_load_f64(double *dst, const void *base, fq_dtype dt, int64_t offset, int64_t n);
void fq_cpu_store_f32(void *base, fq_dtype dt, int64_t offset, const float *src, int64_t n);
void fq_cpu_store_f64(void *base, fq_dtype dt, int64_t offset, const double *src, int64_t n);

/* One element (slow path; for scalars such as g and beta). */
static inline double fq_cpu_load1(const void *base, fq_dtype dt, int64_t i)
{
    switch (dt) {
    case FQ_F32: return ((const float *)base)[i];
    case FQ_F16: return fq_cpu_f16_to_f32(((const uint16_t *)base)[i]);
    case FQ_BF16: return fq_cpu_bf16_to_f32(((const uint16_t *)base)[i]);
    case FQ_F64: return ((const double *)base)[i];
    }
    return 0.0;
}

/* Rules of the CPU forward and recurrent step beyond fq_check_params:
 * 16 <= K, V <= 256 (FQ_ERR_VALUE naming "q" / "v"), gate_dtype F32 or equal
 * to dtype (FQ_ERR_TYPE naming "g"). Defined in gdn_cpu_fwd.c. */
fq_status fq_cpu_check_dims(const fq_gdn_params *p);

/* Prefetch elements offset .. offset+n-1 of an array of dtype dt into the
 * cache (a hint; no-op without GCC/clang builtins). */
static inline void fq_cpu_prefetch_row(const void *base, fq_dtype dt, int64_t offset, int64_t n)
{
#if defined(__GNUC__)
    const size_t es = fq_dtype_size(dt);
    const char *a = (const char *)base + (size_t)offset * es;
    for (size_t b = 0; b < (size_t)n * es; b += 64) __builtin_prefetch(a + b, 0, 2);
#else
    (void)base; (void)dt; (void)offset; (void)n;
#endif
}

/* ------------------------------------------------------ fused gates ---- */

/* softplus(x) = log(1 + e^x), and x itself past 20 (FLA's threshold) */
static inline double fq_cpu_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }
static inline double fq_cpu_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* x = a + dt_bias[j] of the fused gate (element i of p->g holds a) */
static inline double fq_cpu_gate_x(const fq_gdn_params *p, int64_t i, int64_t j)
{
    double a = fq_cpu_load1(p->g, p->gate_dtype, i);
    return p->dt_bias ? a + fq_cpu_load1(p->dt_bias, p->gate_param_dtype, j) : a;
}

/* The log decay g the operator uses for element i = token * HV + j:
 * p->g itself, or with use_gate_in_kernel g = -exp(A_log[j]) softplus(a + dt_bias[j]). */
static inline double fq_cpu_gate_g(const fq_gdn_params *p, int64_t i, int64_t j)
{
    if (!p->use_gate_in_kernel) return fq_cpu_load1(p->g, p->gate_dtype, i);
    return -exp(fq_cpu_load1(p->A_log, p->gate_param_dtype, j)) * fq_cpu_softplus(fq_cpu_gate_x(p, i, j));
}

/* fwd: g = -exp(A_log) softplus(x)  ->  dg/da = dg/ddt_bias = -exp(A_log) sigmoid(x)
 * (and dg/dA_log = g) */
static inline double fq_cpu_gate_dg_da(const fq_gdn_params *p, int64_t i, int64_t j)
{
    return -exp(fq_cpu_load1(p->A_log, p->gate_param_dtype, j)) * fq_cpu_sigmoid(fq_cpu_gate_x(p, i, j));
}

/* beta the operator uses: p->beta, or sigmoid(b) with use_beta_sigmoid_in_kernel */
static inline double fq_cpu_gate_beta(const fq_gdn_params *p, int64_t i)
{
    double b = fq_cpu_load1(p->beta, p->gate_dtype, i);
    return p->use_beta_sigmoid_in_kernel ? fq_cpu_sigmoid(b) : b;
}

/* ------------------------------------------------------------- states ---- */

/* S[i * ld + c] = element (i, c) of the K x V state at element offset `off`
 * of base (dtype dt), stored [K][V] (vk = 0) or [V][K] (vk = 1). */
void fq_cpu_load_state_f32(float *S, int64_t ld, const void *base, fq_dtype dt, int64_t off, int64_t K,
                           int64_t V, int vk);
void fq_cpu_load_state_f64(double *S, int64_t ld, const void *base, fq_dtype dt, int64_t off, int64_t K,
                           int64_t V, int vk);
/* The reverse: element (i, c) of the stored state = S[i * ld + c]. */
void fq_cpu_store_state_f32(void *base, fq_dtype dt, int64_t off, const float *S, int64_t ld, int64_t K,
                            int64_t V, int vk);
void fq_cpu_store_state_f64(void *base, fq_dtype dt, int64_t off, const double *S, int64_t ld, int64_t K,
                            int64_t V, int vk);
/* The one for S's real type (float or double), for the bodies written once
 * per real type (gdn_cpu_*_impl.h, in any instruction-set instantiation). */
#define fq_cpu_load_state(S, ...) \
    _Generic((S), float *: fq_cpu_load_state_f32, double *: fq_cpu_load_state_f64)(S, __VA_ARGS__)
#define fq_cpu_store_state(base, dt, off, S, ...)                                                  \
    _Generic((S), float *: fq_cpu_store_state_f32, const float *: fq_cpu_store_state_f32,          \
             double *: fq_cpu_store_state_f64, const double *: fq_cpu_store_state_f64)(base, dt, off, \
                                                                                    S, __VA_ARGS__)

/* ------------------------------------------------------------ indices ---- */

static inline int64_t fq_cpu_index(const void *base, int is_int64, int64_t i)
{
    return is_int64 ? ((const int64_t *)base)[i] : (int64_t)((const int32_t *)base)[i];
}

/* Sequence n of p: its batch row, its first token within that row, and its
 * length. Token t (0-based) of the sequence is flat token
 * row * p->T + first + t of the [B, T] arrays, so q element (t, h, i) is at
 * ((row * T + first + t) * H + h) * K + i. */
static inline void fq_cpu_seq_bounds(const fq_gdn_params *p, int64_t n, int64_t *row,
                                     int64_t *first, int64_t *len)
{
    if (p->cu_seqlens) {
        int64_t a = fq_cpu_index(p->cu_seqlens, p->cu_seqlens_is_int64, n);
        int64_t b = fq_cpu_index(p->cu_seqlens, p->cu_seqlens_is_int64, n + 1);
        *row = 0;
        *first = a;
        *len = b - a;
    } else {
        *row = n;
        *first = 0;
        *len = p->T;
    }
}

/* ---------------------------------------------------------- L2 norm ---- */

#define FQ_L2NORM_EPS 1e-6

/* x <- x / sqrt(sum_i x_i^2 + 1e-6)   (FLA's l2norm: x * rsqrt(sum x^2 + eps)) */
void fq_cpu_l2norm_f32(float *x, int64_t n);
void fq_cpu_l2norm_f64(double *x, int64_t n);


/* ------------------------------------------------------ small matmuls ---- */

/* C[m x n] = (load_c ? cscale * C : 0) + A[m x k] . B[k x n], all row-major
 * with leading dimensions lda, ldb, ldc (elements). A must not alias C.
 * tri = FQ_TRI_NONE: the full product (a triangular A: fq_cpu_trmm_*).
 * tri = FQ_TRI_N:    only columns j <= i (rounded up to a column tile of at
 *                    most 32) of C are needed; others may be left unwritten
 *                    (they keep what was there).
 * The micro-kernel is the active kernel set's (fq_cpu_kernels_get; register
 * tiles of FQ_GEMM_MR x NR per instruction set, NR dividing 32); columns
 * past the last full NR tile take a plain-C edge loop. Any m, n, k work. */
enum { FQ_TRI_NONE = 0, FQ_TRI_N = 2 };
void fq_cpu_gemm_f32(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda,
                     const float *B, int64_t ldb, float *C, int64_t ldc, float cscale,
                     int load_c, int tri);
void fq_cpu_gemm_f64(int64_t m, int64_t n, int64_t k, const double *A, int64_t lda,
                     const double *B, int64_t ldb, double *C, int64_t ldc, double cscale,
                     int load_c, int tri);

/* ------------------------------------------------ gates with resets ---- */

/* The chunk-local gate scan of gdn.h ("Full resets"): on entry gam[r] = g_r,
 * on exit gam[r] = sum of g_u over z_r < u <= r and seg[r] = z_r, the last
 * u <= r with g_u <= FQ_GATE_RESET (-1 if none). A NaN gate is no reset: it
 * makes the rest of its segment NaN, as in the token recurrence. */
static inline void fq_cpu_gate_scan(double *gam, int *seg, int64_t n)
{
    double acc = 0;
    int z = -1;
    for (int64_t r = 0; r < n; r++) {
        if (gam[r] <= FQ_GATE_RESET) {
            z = (int)r;
            acc = 0;
        } else {
            acc += gam[r];
        }
        gam[r] = acc;
        seg[r] = z;
    }
}

/* ------------------------------------------------ triangular products ---- */

/* C[m x n] = (load_c ? cscale * C : 0) + A.B for a lower-triangular A
 * (lower: row i sums p <= i) or an upper-triangular A (upper: p >= i), row
 * major, A square m x m. Exactly triangular: the entries of A outside the
 * triangle are never read and the rows of B they would meet never reach row i
 * of C, so a NaN in B's row p stays out of the rows that do not depend on it
 * (causality; 0 * NaN would not). The off-diagonal 8-row blocks run on
 * fq_cpu_gemm_*, the diagonal blocks as row axpys (gdn_cpu_trmm.c). */
void fq_cpu_trmm_lower_f32(int64_t m, int64_t n, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, float cscale, int load_c);
void fq_cpu_trmm_lower_f64(int64_t m, int64_t n, const double *A, int64_t lda, const double *B,
                           int64_t ldb, double *C, int64_t ldc, double cscale, int load_c);
void fq_cpu_trmm_upper_f32(int64_t m, int64_t n, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, float cscale, int load_c);
void fq_cpu_trmm_upper_f64(int64_t m, int64_t n, const double *A, int64_t lda, const double *B,
                           int64_t ldb, double *C, int64_t ldc, double cscale, int load_c);

/* ---------------------------------------------------------------- exp ---- */

/* exp(x) in float, vectorisable (no libm call): range reduction
 * x = n ln2 + r, |r| <= ln2/2, degree-7 Taylor polynomial (rel. error
 * ~1e-7), scaled by 2^n. exp(x) = 0 for x < -87 (no subnormals), Inf for
 * x > 88.7, NaN in -> NaN out. */
static inline float fq_cpu_expf(float x)
{
    float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rint */
    float r = xc - n * 0.693145751953125f;                         /* ln2 high */
    r = r - n * 1.42860682030941723212e-6f;                        /* ln2 low  */
    float pl = 1.0f / 5040.0f;
    pl = pl * r + 1.0f / 720.0f;
    pl = pl * r + 1.0f / 120.0f;
    pl = pl * r + 1.0f / 24.0f;
    pl = pl * r + 1.0f / 6.0f;
    pl = pl * r + 0.5f;
    pl = pl * r + 1.0f;
    pl = pl * r + 1.0f;
    float two_n = fq_cpu_bits_to_f32((uint32_t)((int32_t)n + 127) << 23);
    float y = pl * two_n;
    y = x < -87.0f ? 0.0f : y;
    y = x > 88.72f ? INFINITY : y;
    return x != x ? x : y;
}

/* ------------------------------------------ kernel sets per instruction set ---- */

/* The float (F32/F16/BF16 input) kernels of one instruction set. Each
 * gdn_cpu_kernels_<isa>.c defines one table from the same sources (the
 * forward, recurrent and backward bodies gdn_cpu_fwd_impl.h,
 * gdn_cpu_recurrent_impl.h, gdn_cpu_bwd_impl.h, the micro-kernels and tile
 * loads of gdn_cpu_kernels.h) compiled for its
 * instruction set; the x86 ones carry a target pragma, so the rest of the
 * library stays baseline x86-64. F64 inputs run the baseline double code. */
typedef struct {
    const char *isa; /* "avx512", "avx2", "neon", "scalar" */
    size_t (*fwd_scratch_elems)(int64_t Kp, int64_t Vp);
    void (*fwd_item)(void *ctx, int64_t item, int thread_id);     /* ctx: fq_fwd_ctx */
    size_t (*rec_scratch_elems)(int64_t K, int64_t V);
    void (*rec_item)(void *ctx, int64_t item, int thread_id);     /* ctx: fq_rec_ctx */
    void (*gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda, const float *B,
                 int64_t ldb, float *C, int64_t ldc, float cscale, int load_c, int tri);
    /* the tile loads / stores (fq_cpu_load_f32 / fq_cpu_store_f32's contract,
     * bit-identical results; F16/BF16 converted a vector at a time) */
    void (*load_row)(float *dst, const void *base, fq_dtype dt, int64_t offset, int64_t n);
    void (*store_row)(void *base, fq_dtype dt, int64_t offset, const float *src, int64_t n);
    /* the whole float backward (gdn_cpu_bwd_impl.h's chunk_bwd_run) */
    fq_status (*bwd_run)(const fq_gdn_params *p, const int64_t *order, int64_t Tmax);
} fq_cpu_kernels;

/* NULL where the build has no such set (NEON off AArch64, the x86 sets off
 * x86-64). */
extern const fq_cpu_kernels *const fq_cpu_kernels_avx512;
extern const fq_cpu_kernels *const fq_cpu_kernels_avx2;
extern const fq_cpu_kernels *const fq_cpu_kernels_neon;
extern const fq_cpu_kernels *const fq_cpu_kernels_scalar;

/* The kernel set this process runs (see fq_cpu_isa in gdn.h): chosen once;
 * FQ_OK and *out set, or the status and message of fq_cpu_isa. Every CPU
 * entry point calls it first. */
fq_status fq_cpu_kernels_get(const fq_cpu_kernels **out);

/* ------------------------------------------------ work-item contexts ---- */

#define FQ_CHUNK 64     /* tokens per chunk of the chunked forward  */
#define FQ_BWD_CHUNK 64 /* tokens per chunk of the chunked backward */

typedef struct {
    const fq_gdn_params *p;
    int64_t Kp, Vp;  /* K, V rounded up to a multiple of 32 */
    void **scratch;  /* one block per thread */
} fq_fwd_ctx;

#define FQ_NB 32 /* recurrent step: state columns per portable block (K x 32 in L1) */
#define FQ_TG 64 /* recurrent step: tokens loaded and run per block pass           */

typedef struct {
    const fq_gdn_params *p;
    void **scratch; /* one block per thread */
} fq_rec_ctx;

#endif /* FQ_GDN_CPU_H */
