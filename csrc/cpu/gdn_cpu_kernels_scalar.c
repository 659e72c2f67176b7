/*
 * gdn_cpu_kernels_scalar.c — the float kernels in plain C (no intrinsics):
 * the reference fallback, and the path of CPUs with neither AVX2 nor NEON.
 * A "vector" is 4 floats: GCC's and clang's generic vectors (plain
 * operators; the compiler maps them onto the baseline vector unit, SSE2 on
 * x86-64, or onto scalar code), else a struct of 4 floats with loops of 4.
 * GEMM tile 4 x 8 (8 accumulators).
 */
#include "gdn_cpu.h"

#include <string.h>

#define FQ_ISA scalar
#define FQ_ISA_NAME "scalar"
#define FQ_VL 4

#if defined(__GNUC__)
/* GCC / clang generic vectors: plain operators, no instruction set named */
typedef float fq_vf __attribute__((vector_size(16)));

static inline fq_vf fq_v_zero(void) { return (fq_vf){0.0f, 0.0f, 0.0f, 0.0f}; }
static inline fq_vf fq_v_set1(float a) { return (fq_vf){a, a, a, a}; }
static inline fq_vf fq_v_load(const float *p)
{
    fq_vf r;
    memcpy(&r, p, sizeof r);
    return r;
}
static inline void fq_v_store(float *p, fq_vf v) { memcpy(p, &v, sizeof v); }
static inline fq_vf fq_v_fma(fq_vf a, fq_vf b, fq_vf c) { return a * b + c; }
static inline fq_vf fq_v_fnma(fq_vf a, fq_vf b, fq_vf c) { return c - a * b; }
static inline fq_vf fq_v_mul(fq_vf a, fq_vf b) { return a * b; }
#define FQ_V_LANE(v, l) (v)[l]
#else
/* ISO C: a struct of 4 floats, operations as loops of 4 */
typedef struct {
    float x[FQ_VL];
} fq_vf;

#define FQ_V_MAP(expr)                                          \
    fq_vf r;                                                    \
    for (int l = 0; l < FQ_VL; l++) r.x[l] = (expr);            \
    return r

static inline fq_vf fq_v_zero(void) { FQ_V_MAP(0.0f); }
static inline fq_vf fq_v_set1(float a) { FQ_V_MAP(a); }
static inline fq_vf fq_v_load(const float *p) { FQ_V_MAP(p[l]); }
static inline void fq_v_store(float *p, fq_vf v)
{
    for (int l = 0; l < FQ_VL; l++) p[l] = v.x[l];
}
static inline fq_vf fq_v_fma(fq_vf a, fq_vf b, fq_vf c) { FQ_V_MAP(a.x[l] * b.x[l] + c.x[l]); }
static inline fq_vf fq_v_fnma(fq_vf a, fq_vf b, fq_vf c) { FQ_V_MAP(c.x[l] - a.x[l] * b.x[l]); }
static inline fq_vf fq_v_mul(fq_vf a, fq_vf b) { FQ_V_MAP(a.x[l] * b.x[l]); }
#undef FQ_V_MAP
#define FQ_V_LANE(v, l) (v).x[l]
#endif

/* half-precision rows: lane by lane through gdn_cpu.h's conversions */
static inline fq_vf fq_v_load_bf16(const uint16_t *p)
{
    float f[FQ_VL];
    for (int l = 0; l < FQ_VL; l++) f[l] = fq_cpu_bf16_to_f32(p[l]);
    return fq_v_load(f);
}
static inline fq_vf fq_v_load_f16(const uint16_t *p)
{
    float f[FQ_VL];
    for (int l = 0; l < FQ_VL; l++) f[l] = fq_cpu_f16_to_f32(p[l]);
    return fq_v_load(f);
}
static inline void fq_v_store_bf16(uint16_t *p, fq_vf v)
{
    for (int l = 0; l < FQ_VL; l++) p[l] = fq_cpu_f32_to_bf16(FQ_V_LANE(v, l));
}
static inline void fq_v_store_f16(uint16_t *p, fq_vf v)
{
    for (int l = 0; l < FQ_VL; l++) p[l] = fq_cpu_f32_to_f16(FQ_V_LANE(v, l));
}

#define FQ_GEMM_MR 4
#define FQ_GEMM_NV 2
#define FQ_REC_NZ 2
#define FQ_REC_NZ_MID 1

#include "gdn_cpu_kernels.h"
