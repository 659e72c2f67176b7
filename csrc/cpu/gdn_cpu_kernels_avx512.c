/*
 * gdn_cpu_kernels_avx512.c — the float kernels for x86-64 CPUs with AVX-512
 * F/BW/DQ/VL (Skylake-SP and later, Zen 4 and later): 16 lanes, GEMM tile
 * 8 x 32 (16 zmm accumulators), recurrent blocks of 128 columns (whole
 * 512-byte state rows). Compiled for that instruction set by the target
 * pragma below, whatever the build's -march; run only where
 * gdn_cpu_dispatch.c found it. Empty on other architectures.
 */
#include "gdn_cpu.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")
#endif

#define FQ_ISA avx512
#define FQ_ISA_NAME "avx512"
#define FQ_VL 16
typedef __m512 fq_vf;

static inline fq_vf fq_v_zero(void) { return _mm512_setzero_ps(); }
static inline fq_vf fq_v_set1(float a) { return _mm512_set1_ps(a); }
static inline fq_vf fq_v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void fq_v_store(float *p, fq_vf v) { _mm512_storeu_ps(p, v); }
static inline fq_vf fq_v_fma(fq_vf a, fq_vf b, fq_vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline fq_vf fq_v_fnma(fq_vf a, fq_vf b, fq_vf c) { return _mm512_fnmadd_ps(a, b, c); }
static inline fq_vf fq_v_mul(fq_vf a, fq_vf b) { return _mm512_mul_ps(a, b); }
/* bf16 -> float: the 16 bits become the top half of the float */
static inline fq_vf fq_v_load_bf16(const uint16_t *p)
{
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
static inline fq_vf fq_v_load_f16(const uint16_t *p)
{
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* float -> bf16, round to nearest even: u + 0x7fff + (bit 16 of u), top
 * half; NaN: the top half with the quiet bit set */
static inline void fq_v_store_bf16(uint16_t *p, fq_vf v)
{
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rne = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __m512i qnan = _mm512_srli_epi32(_mm512_or_si512(u, _mm512_set1_epi32(0x400000)), 16);
    const __mmask16 isnan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                    _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rne, isnan, qnan)));
}
static inline void fq_v_store_f16(uint16_t *p, fq_vf v)
{
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* dst[j][i] = src[i][j] for a 16 x 16 float block, in registers: pairs of
 * rows interleaved (unpack), then 2 x 2, 4 x 4 and 8 x 8 blocks swapped. */
static inline void fq_bwd_transpose16_f32(float *dst, int64_t ldd, const float *src, int64_t lds)
{
    __m512 r[16], t[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * lds);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 16; i += 8)
        for (int l = 0; l < 4; l++) {
            t[i + l] = _mm512_shuffle_f32x4(r[i + l], r[i + l + 4], 0x88);
            t[i + l + 4] = _mm512_shuffle_f32x4(r[i + l], r[i + l + 4], 0xDD);
        }
    for (int l = 0; l < 8; l++) {
        r[l] = _mm512_shuffle_f32x4(t[l], t[l + 8], 0x88);
        r[l + 8] = _mm512_shuffle_f32x4(t[l], t[l + 8], 0xDD);
    }
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ldd, r[i]);
}
#define FQ_BWD_HAVE_TRANSPOSE16_F32 1

#define FQ_GEMM_MR 8
#define FQ_GEMM_NV 2
#define FQ_REC_NZ 8
#define FQ_REC_NZ_MID 2

#include "gdn_cpu_kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#endif

#else
const fq_cpu_kernels *const fq_cpu_kernels_avx512 = NULL;
#endif
