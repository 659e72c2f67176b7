/*
 * gdn_cpu_kernels_neon.c — the float kernels for AArch64 (Advanced SIMD,
 * present on every AArch64 CPU, so chosen at build time): 4 lanes, GEMM tile
 * 6 x 16 (24 of the 32 vector registers accumulate), recurrent blocks of 32
 * columns. Checked under qemu-user in CI (.ci/run); its speed cannot be
 * measured on the project's x86 machines. Empty on other architectures.
 */
#include "gdn_cpu.h"

#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

#define FQ_ISA neon
#define FQ_ISA_NAME "neon"
#define FQ_VL 4
typedef float32x4_t fq_vf;

static inline fq_vf fq_v_zero(void) { return vdupq_n_f32(0.0f); }
static inline fq_vf fq_v_set1(float a) { return vdupq_n_f32(a); }
static inline fq_vf fq_v_load(const float *p) { return vld1q_f32(p); }
static inline void fq_v_store(float *p, fq_vf v) { vst1q_f32(p, v); }
static inline fq_vf fq_v_fma(fq_vf a, fq_vf b, fq_vf c) { return vfmaq_f32(c, a, b); }
static inline fq_vf fq_v_fnma(fq_vf a, fq_vf b, fq_vf c) { return vfmsq_f32(c, a, b); }
static inline fq_vf fq_v_mul(fq_vf a, fq_vf b) { return vmulq_f32(a, b); }
/* bf16 -> float: the 16 bits become the top half of the float */
static inline fq_vf fq_v_load_bf16(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
}
static inline fq_vf fq_v_load_f16(const uint16_t *p)
{
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
/* float -> bf16, round to nearest even: u + 0x7fff + (bit 16 of u), top
 * half; NaN: the top half with the quiet bit set */
static inline void fq_v_store_bf16(uint16_t *p, fq_vf v)
{
    const uint32x4_t u = vreinterpretq_u32_f32(v);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    const uint32x4_t rne = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7fff)), lsb);
    const uint32x4_t qnan = vorrq_u32(u, vdupq_n_u32(0x400000));
    const uint32x4_t isnan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7fffffff)), vdupq_n_u32(0x7f800000));
    vst1_u16(p, vshrn_n_u32(vbslq_u32(isnan, qnan, rne), 16));
}
/* the FPCR's default rounding (to nearest even) and NaN propagation match
 * fq_cpu_f32_to_f16 */
static inline void fq_v_store_f16(uint16_t *p, fq_vf v)
{
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));
}

#define FQ_GEMM_MR 6
#define FQ_GEMM_NV 4
#define FQ_REC_NZ 8
#define FQ_REC_NZ_MID 2

#include "gdn_cpu_kernels.h"

#else
const fq_cpu_kernels *const fq_cpu_kernels_neon = NULL;
#endif
