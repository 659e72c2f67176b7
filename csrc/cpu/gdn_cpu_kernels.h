/*
 * gdn_cpu_kernels.h — the float kernels of the CPU backend, written once on a
 * small set of vector operations and compiled once per instruction set: each
 * gdn_cpu_kernels_<isa>.c defines the operations below for its vector unit
 * (and, on x86, a target pragma), then includes this file. What comes out is
 * the kernel table fq_cpu_kernels_<isa> (gdn_cpu.h) holding
 *
 *   - the GEMM micro-kernel and its driver (fq_cpu_gemm_f32's contract),
 *   - the recurrent step's vector block kernel,
 *   - the tile loads and stores: F32/F16/BF16 rows converted to and from
 *     float as they are read into (written out of) a chunk's tiles, so half
 *     precision inputs never take a separate conversion pass,
 *   - gdn_cpu_fwd_impl.h and gdn_cpu_recurrent_impl.h instantiated for float
 *     on top of them.
 *
 * The instruction set file defines:
 *
 *   FQ_ISA, FQ_ISA_NAME   token and string: avx512 / "avx512", ...
 *   FQ_VL                 float lanes of a vector
 *   fq_vf                 the vector type; and, as static inline functions,
 *   fq_v_zero() fq_v_set1(x) fq_v_load(p) fq_v_store(p, v)      (unaligned)
 *   fq_v_fma(a, b, c) = a b + c    fq_v_fnma(a, b, c) = c - a b
 *   fq_v_mul(a, b)
 *   fq_v_load_bf16(p) fq_v_load_f16(p)          FQ_VL halves -> floats
 *   fq_v_store_bf16(p, v) fq_v_store_f16(p, v)  floats -> halves, round to
 *                                               nearest even, NaN stays NaN
 *                                               (bit-identical to
 *                                               fq_cpu_f32_to_bf16 / _f16)
 *   FQ_GEMM_MR, FQ_GEMM_NV  GEMM register tile: MR rows x NV vectors
 *                           (MR <= 8, NV * FQ_VL dividing 32)
 *   FQ_REC_NZ, FQ_REC_NZ_MID  vectors per recurrent block (wide, middle)
 */
#ifndef FQ_ISA
#error "gdn_cpu_kernels.h is included by a gdn_cpu_kernels_<isa>.c after its vector operations"
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FQ_KCAT_(a, b) a##_##b
#define FQ_KCAT(a, b) FQ_KCAT_(a, b)
#define FQ_K(name) FQ_KCAT(name, FQ_ISA)
#define FQ_GEMM_NR (FQ_GEMM_NV * FQ_VL)
/* fully unrolled register loops (constant trip counts <= 8): the arrays of
 * vectors they index then live in registers */
#if defined(__clang__)
#define FQ_UNROLL _Pragma("unroll")
#else
#define FQ_UNROLL _Pragma("GCC unroll 8")
#endif
#define FQ_REC_PF_ROWS 4 /* rows of the state prefetched ahead (recurrent step) */

/* ------------------------------------------------------------- GEMM ---- */

/* Edge tile (columns past the last full NR tile): C[mr x nr] = cscale*C + A.B
 * over kc, plain loops. */
static void FQ_K(gemm_tile_edge)(int64_t mr, int64_t nr, int64_t kc, const float *restrict A,
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
            const float a = A[i * lda + p];
            const float *restrict b = B + p * ldb;
            for (int64_t j = 0; j < nr; j++) c[j] += a * b[j];
        }
    }
}

/* The register tile: C[mr x NR] = (load_c ? cscale C : 0) + A[mr x kc] B[kc x NR].
 * mr (<= MR) is a constant at every call, so the accumulators c[][] live in
 * MR x NV vector registers; per k step NV loads of B's row and mr broadcasts
 * of A's column feed mr x NV FMAs. */
static inline __attribute__((always_inline)) void
FQ_K(gemm_tile)(const int mr, int64_t kc, const float *restrict A, int64_t lda,
                const float *restrict B, int64_t ldb, float *restrict C, int64_t ldc,
                float cscale, int load_c)
{
    fq_vf c[FQ_GEMM_MR][FQ_GEMM_NV];
    if (load_c) {
        const fq_vf s = fq_v_set1(cscale);
        FQ_UNROLL for (int i = 0; i < mr; i++)
            FQ_UNROLL for (int z = 0; z < FQ_GEMM_NV; z++)
                c[i][z] = fq_v_mul(s, fq_v_load(C + i * ldc + z * FQ_VL));
    } else {
        FQ_UNROLL for (int i = 0; i < mr; i++)
            FQ_UNROLL for (int z = 0; z < FQ_GEMM_NV; z++) c[i][z] = fq_v_zero();
    }
    for (int64_t p = 0; p < kc; p++) {
        fq_vf b[FQ_GEMM_NV];
        FQ_UNROLL for (int z = 0; z < FQ_GEMM_NV; z++) b[z] = fq_v_load(B + p * ldb + z * FQ_VL);
        FQ_UNROLL for (int i = 0; i < mr; i++) {
            const fq_vf a = fq_v_set1(A[i * lda + p]);
            FQ_UNROLL for (int z = 0; z < FQ_GEMM_NV; z++) c[i][z] = fq_v_fma(a, b[z], c[i][z]);
        }
    }
    FQ_UNROLL for (int i = 0; i < mr; i++)
        FQ_UNROLL for (int z = 0; z < FQ_GEMM_NV; z++) fq_v_store(C + i * ldc + z * FQ_VL, c[i][z]);
}

/* fq_cpu_gemm_f32 (gdn_cpu.h) on this instruction set. */
static void FQ_K(gemm)(int64_t m, int64_t n, int64_t k, const float *A, int64_t lda,
                       const float *B, int64_t ldb, float *C, int64_t ldc, float cscale,
                       int load_c, int tri)
{
    /* column tiles outermost: B's k x NR panel stays in L1 across row tiles */
    for (int64_t j0 = 0; j0 < n; j0 += FQ_GEMM_NR) {
        const int64_t nr = n - j0 < FQ_GEMM_NR ? n - j0 : FQ_GEMM_NR;
        for (int64_t i0 = 0; i0 < m; i0 += FQ_GEMM_MR) {
            const int64_t mr = m - i0 < FQ_GEMM_MR ? m - i0 : FQ_GEMM_MR;
            if (tri == FQ_TRI_N && j0 > i0 + mr - 1) continue;
            const int64_t kc = k;
            const float *a = A + i0 * lda;
            const float *b = B + j0;
            float *c = C + i0 * ldc + j0;
            if (nr < FQ_GEMM_NR) {
                FQ_K(gemm_tile_edge)(mr, nr, kc, a, lda, b, ldb, c, ldc, cscale, load_c);
                continue;
            }
            switch (mr) { /* one inlined copy per row count (r <= MR always holds) */
#define FQ_TILE_CASE(r)                                                                         \
    case r:                                                                                     \
        FQ_K(gemm_tile)(r < FQ_GEMM_MR ? r : FQ_GEMM_MR, kc, a, lda, b, ldb, c, ldc, cscale,    \
                        load_c);                                                                \
        break;
                FQ_TILE_CASE(1) FQ_TILE_CASE(2) FQ_TILE_CASE(3) FQ_TILE_CASE(4)
#if FQ_GEMM_MR > 4
                FQ_TILE_CASE(5) FQ_TILE_CASE(6)
#endif
#if FQ_GEMM_MR > 6
                FQ_TILE_CASE(7) FQ_TILE_CASE(8)
#endif
#undef FQ_TILE_CASE
            default: break;
            }
        }
    }
}

/* ------------------------------------------------ tile loads / stores ---- */

/* dst[0..n) = row elements offset .. offset+n-1 of base (dtype dt) as floats:
 * the vector conversion for F16/BF16, fq_cpu_load_f32 for the tail and F64. */
static void FQ_K(load_row)(float *restrict dst, const void *base, fq_dtype dt,
                                  int64_t offset, int64_t n)
{
    int64_t i = 0;
    if (dt == FQ_F32) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *s = (const uint16_t *)base + offset;
    if (dt == FQ_BF16)
        for (; i + FQ_VL <= n; i += FQ_VL) fq_v_store(dst + i, fq_v_load_bf16(s + i));
    else if (dt == FQ_F16)
        for (; i + FQ_VL <= n; i += FQ_VL) fq_v_store(dst + i, fq_v_load_f16(s + i));
    if (i < n) fq_cpu_load_f32(dst + i, base, dt, offset + i, n - i);
}

/* Row elements offset .. offset+n-1 of base (dtype dt) = src[0..n), rounded
 * to nearest even for F16/BF16. */
static void FQ_K(store_row)(void *base, fq_dtype dt, int64_t offset, const float *restrict src,
                                   int64_t n)
{
    int64_t i = 0;
    if (dt == FQ_F32) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
        return;
    }
    uint16_t *d = (uint16_t *)base + offset;
    if (dt == FQ_BF16)
        for (; i + FQ_VL <= n; i += FQ_VL) fq_v_store_bf16(d + i, fq_v_load(src + i));
    else if (dt == FQ_F16)
        for (; i + FQ_VL <= n; i += FQ_VL) fq_v_store_f16(d + i, fq_v_load(src + i));
    if (i < n) fq_cpu_store_f32(base, dt, offset + i, src + i, n - i);
}

/* x <- x / sqrt(sum x^2 + 1e-6), the sum in 16 partial sums (vectorises) */
static inline void FQ_K(l2norm)(float *x, int64_t n)
{
    float part[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) part[l] += x[i + l] * x[i + l];
    float ss = 0.0f;
    for (; i < n; i++) ss += x[i] * x[i];
    for (int l = 0; l < 16; l++) ss += part[l];
    const float r = 1.0f / sqrtf(ss + (float)FQ_L2NORM_EPS);
    for (i = 0; i < n; i++) x[i] *= r;
}

/* -------------------------------------------- recurrent block kernel ---- */

/* Tokens 0..nt-1 of a group on columns c0 .. c0 + nz*FQ_VL - 1 of S (K x V,
 * row-major; the equations are gdn_cpu_recurrent_impl.h's): a row of the
 * block is nz vectors, S^T k and S^T q accumulate in 2 nz vectors, u in nz
 * more. nz is a constant at every call (inlined), so the arrays live in
 * registers. */
static inline __attribute__((always_inline)) void
FQ_K(rec_block)(float *restrict S, int64_t K, int64_t V, int64_t c0, int64_t nt,
                const float *q, const float *k, const float *v, float *o, const float *alpha,
                const float *beta, const float *kqs, float scale, const int nz)
{
    fq_vf sk[FQ_REC_NZ], sq[FQ_REC_NZ], u[FQ_REC_NZ];
    FQ_UNROLL for (int z = 0; z < nz; z++) sk[z] = sq[z] = fq_v_zero();
    /* The first block's pass prefetches whole rows FQ_REC_PF_ROWS ahead
     * when the block is narrower than the state: the state then streams in
     * sequentially (as with full-row blocks), not as nz-vector slices 4 V
     * bytes apart, and the later blocks find it in cache. */
    const int prefetch = c0 == 0 && (int64_t)nz * FQ_VL < V;
    /* sk = S^T k_0, sq = S^T q_0 */
    for (int64_t i = 0; i < K; i++) {
        const float *s = S + i * V + c0;
#if defined(__GNUC__)
        if (prefetch && i + FQ_REC_PF_ROWS < K) {
            const char *row = (const char *)(S + (i + FQ_REC_PF_ROWS) * V);
            for (int64_t b = 0; b < V * (int64_t)sizeof(float); b += 64) __builtin_prefetch(row + b, 1, 3);
        }
#endif
        const fq_vf ki = fq_v_set1(k[i]), qi = fq_v_set1(q[i]);
        FQ_UNROLL for (int z = 0; z < nz; z++) {
            const fq_vf x = fq_v_load(s + z * FQ_VL);
            sk[z] = fq_v_fma(ki, x, sk[z]);
            sq[z] = fq_v_fma(qi, x, sq[z]);
        }
    }
    const fq_vf vscale = fq_v_set1(scale);
    for (int64_t t = 0; t < nt; t++) {
        const fq_vf a = fq_v_set1(alpha[t]), b = fq_v_set1(beta[t]), kq = fq_v_set1(kqs[t]);
        const float *vt = v + t * V + c0;
        float *ot = o + t * V + c0;
        /* u = beta (v - alpha S^T k);  o = scale (alpha S^T q + u (k . q)) */
        FQ_UNROLL for (int z = 0; z < nz; z++) {
            u[z] = fq_v_mul(b, fq_v_fnma(a, sk[z], fq_v_load(vt + z * FQ_VL)));
            fq_v_store(ot + z * FQ_VL, fq_v_mul(vscale, fq_v_fma(u[z], kq, fq_v_mul(a, sq[z]))));
        }
        /* S = alpha S + k u^T, fused with S^T k', S^T q' of token t+1 */
        const float *kt = k + t * K;
        if (t + 1 < nt) {
            const float *kn = k + (t + 1) * K, *qn = q + (t + 1) * K;
            FQ_UNROLL for (int z = 0; z < nz; z++) sk[z] = sq[z] = fq_v_zero();
            for (int64_t i = 0; i < K; i++) {
                float *s = S + i * V + c0;
                const fq_vf ki = fq_v_set1(kt[i]), kni = fq_v_set1(kn[i]), qni = fq_v_set1(qn[i]);
                FQ_UNROLL for (int z = 0; z < nz; z++) {
                    const fq_vf x = fq_v_fma(a, fq_v_load(s + z * FQ_VL), fq_v_mul(ki, u[z]));
                    fq_v_store(s + z * FQ_VL, x);
                    sk[z] = fq_v_fma(kni, x, sk[z]);
                    sq[z] = fq_v_fma(qni, x, sq[z]);
                }
            }
        } else {
            for (int64_t i = 0; i < K; i++) {
                float *s = S + i * V + c0;
                const fq_vf ki = fq_v_set1(kt[i]);
                FQ_UNROLL for (int z = 0; z < nz; z++)
                    fq_v_store(s + z * FQ_VL, fq_v_fma(a, fq_v_load(s + z * FQ_VL), fq_v_mul(ki, u[z])));
            }
        }
    }
}

/* FQ_REC_VEC_BLOCKS of gdn_cpu_recurrent_impl.h: wide blocks (FQ_REC_NZ
 * vectors: whole rows of a 128-column state where registers allow, which
 * streams the state sequentially), then middle and one-vector blocks;
 * returns the columns done (a multiple of FQ_VL). */
static int64_t FQ_K(rec_blocks)(float *S, int64_t K, int64_t V, int64_t nt, const float *q,
                                const float *k, const float *v, float *o, const float *alpha,
                                const float *beta, const float *kq, float scale)
{
    int64_t c0 = 0;
    for (; c0 + FQ_REC_NZ * FQ_VL <= V; c0 += FQ_REC_NZ * FQ_VL)
        FQ_K(rec_block)(S, K, V, c0, nt, q, k, v, o, alpha, beta, kq, scale, FQ_REC_NZ);
    for (; c0 + FQ_REC_NZ_MID * FQ_VL <= V; c0 += FQ_REC_NZ_MID * FQ_VL)
        FQ_K(rec_block)(S, K, V, c0, nt, q, k, v, o, alpha, beta, kq, scale, FQ_REC_NZ_MID);
    for (; c0 + FQ_VL <= V; c0 += FQ_VL)
        FQ_K(rec_block)(S, K, V, c0, nt, q, k, v, o, alpha, beta, kq, scale, 1);
    return c0;
}

/* ---------------------- the forward, the recurrent step, the backward ---- */

#define REAL float
#define FQ_SFX(name) FQ_KCAT(name##_f32, FQ_ISA)
#define FQ_LOAD FQ_K(load_row)
#define FQ_STORE FQ_K(store_row)
#define FQ_GEMM FQ_K(gemm)
#define FQ_TRMM_LOWER fq_cpu_trmm_lower_f32 /* its off-diagonal blocks: FQ_K(gemm) */
#define FQ_EXP fq_cpu_expf
#define FQ_L2NORM FQ_K(l2norm)
#include "gdn_cpu_fwd_impl.h"
#define FQ_REC_VEC_BLOCKS FQ_K(rec_blocks)
#include "gdn_cpu_recurrent_impl.h"
#undef FQ_REC_VEC_BLOCKS
#undef FQ_SFX
#undef FQ_LOAD
#undef FQ_STORE
#undef FQ_GEMM
#undef FQ_TRMM_LOWER
#undef FQ_L2NORM

/* the backward: FQ_SFX names its functions (chunk_bwd_run_f32_<isa>), the
 * helpers are this set's (the L2 norm keeps the sequential sum that the
 * backward's l2_inv repeats; the triangular products' off-diagonal blocks
 * reach this set's GEMM through fq_cpu_gemm_f32) */
#define FQ_SFX FQ_KCAT(f32, FQ_ISA)
#define FQ_LOAD FQ_K(load_row)
#define FQ_STORE FQ_K(store_row)
#define FQ_L2NORM fq_cpu_l2norm_f32
#define FQ_GEMM FQ_K(gemm)
#define FQ_TRMM_LOWER fq_cpu_trmm_lower_f32
#define FQ_TRMM_UPPER fq_cpu_trmm_upper_f32
#define FQ_BWD_REAL_IS_F32 1
#include "gdn_cpu_bwd_impl.h" /* (it #undefs FQ_EXP and the helpers' names) */
#undef FQ_BWD_REAL_IS_F32

static const fq_cpu_kernels FQ_K(table) = {
    FQ_ISA_NAME,
    FQ_KCAT(fwd_scratch_elems_f32, FQ_ISA), FQ_KCAT(fwd_item_f32, FQ_ISA),
    FQ_KCAT(rec_scratch_elems_f32, FQ_ISA), FQ_KCAT(rec_item_f32, FQ_ISA),
    FQ_K(gemm),
    FQ_K(load_row), FQ_K(store_row),
    FQ_KCAT(chunk_bwd_run, FQ_SFX),
};
const fq_cpu_kernels *const FQ_KCAT(fq_cpu_kernels, FQ_ISA) = &FQ_K(table);

#undef FQ_SFX
#undef REAL
