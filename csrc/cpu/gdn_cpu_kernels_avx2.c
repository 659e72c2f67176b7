/*
 * gdn_cpu_kernels_avx2.c — the float kernels for x86-64 CPUs with AVX2, FMA
 * and F16C (Haswell and later, Zen and later): 8 lanes, GEMM tile 6 x 16
 * (12 ymm accumulators, 2 for B's row, 1 broadcast of 16 registers),
 * recurrent blocks of 32 columns. Compiled for that instruction set by the
 * target pragma below, whatever the build's -march; run only where
 * gdn_cpu_dispatch.c found it. Empty on other architectures.
 */
#include "gdn_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#endif
/* (a FLASHQLA_NATIVE=1 build adds the host's whole instruction set to every
 * file, this one included: forcing avx2 there runs these kernels, compiled
 * with whatever the host has; the portable build keeps them AVX2-only) */

#define FQ_ISA avx2
#define FQ_ISA_NAME "avx2"
#define FQ_VL 8
typedef __m256 fq_vf;

static inline fq_vf fq_v_zero(void) { return _mm256_setzero_ps(); }
static inline fq_vf fq_v_set1(float a) { return _mm256_set1_ps(a); }
static inline fq_vf fq_v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline void fq_v_store(float *p, fq_vf v) { _mm256_storeu_ps(p, v); }
static inline fq_vf fq_v_fma(fq_vf a, fq_vf b, fq_vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline fq_vf fq_v_fnma(fq_vf a, fq_vf b, fq_vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline fq_vf fq_v_mul(fq_vf a, fq_vf b) { return _mm256_mul_ps(a, b); }
/* bf16 -> float: the 16 bits become the top half of the float */
static inline fq_vf fq_v_load_bf16(const uint16_t *p)
{
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
static inline fq_vf fq_v_load_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
/* float -> bf16, round to nearest even: u + 0x7fff + (bit 16 of u), top
 * half; NaN: the top half with the quiet bit set */
static inline void fq_v_store_bf16(uint16_t *p, fq_vf v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i qnan = _mm256_srli_epi32(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), 16);
    const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                             _mm256_set1_epi32(0x7f800000));
    const __m256i h = _mm256_blendv_epi8(rne, qnan, isnan);
    /* 8 x 32-bit (each < 2^16) -> 8 x 16-bit: pack within lanes, then the
     * two 64-bit halves that hold them side by side */
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
static inline void fq_v_store_f16(uint16_t *p, fq_vf v)
{
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* dst[j][i] = src[i][j] for an 8 x 8 float block, in registers: pairs of
 * rows interleaved (unpack), 2 x 2 blocks swapped (shuffle), then the 128-bit
 * halves (permute) */
static inline void fq_avx2_transpose8(float *dst, int64_t ldd, const float *src, int64_t lds)
{
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int l = 0; l < 4; l++) {
        t[l] = _mm256_permute2f128_ps(r[l], r[l + 4], 0x20);
        t[l + 4] = _mm256_permute2f128_ps(r[l], r[l + 4], 0x31);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ldd, t[i]);
}

/* the backward's 16 x 16 transpose block as four 8 x 8 ones */
static inline void fq_bwd_transpose16_f32(float *dst, int64_t ldd, const float *src, int64_t lds)
{
    fq_avx2_transpose8(dst, ldd, src, lds);
    fq_avx2_transpose8(dst + 8, ldd, src + 8 * lds, lds);
    fq_avx2_transpose8(dst + 8 * ldd, ldd, src + 8, lds);
    fq_avx2_transpose8(dst + 8 * ldd + 8, ldd, src + 8 * lds + 8, lds);
}
#define FQ_BWD_HAVE_TRANSPOSE16_F32 1

#define FQ_GEMM_MR 6
#define FQ_GEMM_NV 2
#define FQ_REC_NZ 4
#define FQ_REC_NZ_MID 2

#include "gdn_cpu_kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const fq_cpu_kernels *const fq_cpu_kernels_avx2 = NULL;
#endif
