/*
 * gdn_cpu_trmm.c — products with a triangular left factor, exactly
 * triangular (declared in gdn_cpu.h):
 *
 *     lower:  C_i = c0_i + sum_{p <= i} A_ip B_p
 *     upper:  C_i = c0_i + sum_{p >= i} A_ip B_p        c0 = load_c ? cscale C : 0
 *
 * Why not one fq_cpu_gemm over the whole square: a full product also adds
 * A_ip B_p = 0 * B_p for p outside the triangle, and 0 * NaN = NaN, so a NaN
 * in one token's row of B would reach the rows of earlier (lower) or later
 * (upper) tokens, which do not depend on it. Here the 8-row blocks of C take
 * their off-diagonal part from fq_cpu_gemm (every A entry there is inside the
 * triangle) and their diagonal 8 x 8 block from row axpys over p <= i (p >= i).
 */
#include "gdn_cpu.h"

#define FQ_TRMM_MB 8 /* rows of C per block: the gemm micro-kernel's row count */

#define FQ_TRMM_DEFINE(SFX, REAL)                                                              \
    void fq_cpu_trmm_lower_##SFX(int64_t m, int64_t n, const REAL *A, int64_t lda,            \
                                 const REAL *B, int64_t ldb, REAL *C, int64_t ldc, REAL cscale, \
                                 int load_c)                                                   \
    {                                                                                          \
        for (int64_t i0 = 0; i0 < m; i0 += FQ_TRMM_MB) {                                       \
            const int64_t mr = m - i0 < FQ_TRMM_MB ? m - i0 : FQ_TRMM_MB;                      \
            /* p < i0: inside the triangle for every row of the block */                      \
            fq_cpu_gemm_##SFX(mr, n, i0, A + i0 * lda, lda, B, ldb, C + i0 * ldc, ldc, cscale, \
                              load_c, FQ_TRI_NONE);                                            \
            /* i0 <= p <= i */                                                                 \
            for (int64_t i = i0; i < i0 + mr; i++) {                                           \
                REAL *restrict c = C + i * ldc;                                                \
                for (int64_t p = i0; p <= i; p++) {                                            \
                    const REAL a = A[i * lda + p];                                             \
                    const REAL *restrict b = B + p * ldb;                                      \
                    for (int64_t j = 0; j < n; j++) c[j] += a * b[j];                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    void fq_cpu_trmm_upper_##SFX(int64_t m, int64_t n, const REAL *A, int64_t lda,            \
                                 const REAL *B, int64_t ldb, REAL *C, int64_t ldc, REAL cscale, \
                                 int load_c)                                                   \
    {                                                                                          \
        for (int64_t i0 = 0; i0 < m; i0 += FQ_TRMM_MB) {                                       \
            const int64_t mr = m - i0 < FQ_TRMM_MB ? m - i0 : FQ_TRMM_MB, i1 = i0 + mr;        \
            /* p >= i1: inside the triangle for every row of the block */                     \
            fq_cpu_gemm_##SFX(mr, n, m - i1, A + i0 * lda + i1, lda, B + i1 * ldb, ldb,        \
                              C + i0 * ldc, ldc, cscale, load_c, FQ_TRI_NONE);                 \
            /* i <= p < i1 */                                                                  \
            for (int64_t i = i0; i < i1; i++) {                                                \
                REAL *restrict c = C + i * ldc;                                                \
                for (int64_t p = i; p < i1; p++) {                                             \
                    const REAL a = A[i * lda + p];                                             \
                    const REAL *restrict b = B + p * ldb;                                      \
                    for (int64_t j = 0; j < n; j++) c[j] += a * b[j];                          \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
    }

FQ_TRMM_DEFINE(f32, float)
FQ_TRMM_DEFINE(f64, double)
