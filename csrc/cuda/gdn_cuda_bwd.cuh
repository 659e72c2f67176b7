/*
 * gdn_cuda_bwd.cuh — what the CUDA backward's files share (internal): the
 * argument block of the backward kernels, small shared-memory helpers, and the
 * launchers of the kernels of gdn_cuda_bwd_fused.cu and gdn_cuda_bwd_state.cu
 * called by the host code in gdn_cuda_bwd.cu. Include only from
 * csrc/gdn_cuda_bwd*.cu.
 */
#ifndef FQ_GDN_CUDA_BWD_CUH
#define FQ_GDN_CUDA_BWD_CUH

#include "gdn_cuda_common.cuh"

/* ------------------------------------------------------- small helpers ---- */

static __device__ __forceinline__ float fq_bf(fq_bf16 x) { return __bfloat162float(x); }

/* Sum over the 4 lanes of a quad (one accumulator row). */
static __device__ __forceinline__ float fq_quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

/* Causality (issue 9): the non-finite elements of one 16-byte piece of bf16
 * to zero, in place (a select; the piece is rewritten only when it holds one). */
static __device__ __forceinline__ void fq_zero_nonfinite8(uint4 *pp)
{
    uint4 x = *pp;
    uint32_t *xs = (uint32_t *)&x;
    if (fq_bf16x8_nonfinite(x)) {
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint32_t y = xs[q] & 0x7f807f80u;
            xs[q] &= ((y & 0xffffu) == 0x7f80u ? 0xffff0000u : 0xffffffffu) &
                     ((y >> 16) == 0x7f80u ? 0x0000ffffu : 0xffffffffu);
        }
        *pp = x;
    }
}

/* rows x D bf16, global row r at src + r * stride (16-byte aligned), rows >=
 * len zero-filled, by cp.async: every load of the block in flight at once.
 * The caller commits and waits. */
template <int D>
static __device__ __forceinline__ void fq_async_rows(fq_bf16 *dst, int ld, const fq_bf16 *src,
                                                     int64_t stride, int rows, int len)
{
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        const bool ok = r < len;
        fq_cp_async16(dst + r * ld + c, src + (ok ? r * stride + c : 0), ok ? 16 : 0);
    }
}

/* Causality inside a chunk (issue 9): the non-finite elements of a rows x D
 * bf16 tile loaded by fq_async_rows<D> set to zero (a select; rare: a piece
 * is rewritten only when it holds one). Each thread touches only the
 * 16-byte pieces it copied (or scaled, fq_scale_rows: the same pieces)
 * itself, so it runs right after the thread's cp.async wait, before the
 * barrier that publishes the tile (fq_bf16x8_nonfinite finds them). */
template <int D>
static __device__ __forceinline__ void fq_finite_rows(fq_bf16 *t, int ld, int rows)
{
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        fq_zero_nonfinite8((uint4 *)(t + r * ld + c));
    }
}

/* Causality (issue 9): 1 iff one of the 16-byte pieces of a rows x D bf16
 * tile that this thread visits (the fq_async_rows<D> mapping) holds a
 * non-finite value (fq_bf16x8_nonfinite; no writes). */
template <int D>
static __device__ __forceinline__ int fq_nonfinite_rows(const fq_bf16 *t, int ld, int rows)
{
    int b = 0;
    for (int idx = threadIdx.x; idx < rows * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        b |= fq_bf16x8_nonfinite(*(const uint4 *)(t + r * ld + c));
    }
    return b;
}

/* In place: row r of a 64 x D bf16 tile times rs[r]. */
template <int D>
static __device__ __forceinline__ void fq_scale_rows(fq_bf16 *t, int ld, const float *rs)
{
    for (int idx = threadIdx.x; idx < 64 * (D / 8); idx += blockDim.x) {
        const int r = idx / (D / 8), c = (idx % (D / 8)) * 8;
        const float f = rs[r];
        uint4 *pp = (uint4 *)(t + r * ld + c);
        uint4 x = *pp;
        uint32_t *xs = (uint32_t *)&x;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            float2 f2 = fq_unpack_bf16(xs[q]);
            xs[q] = fq_pack_bf16(f2.x * f, f2.y * f);
        }
        *pp = x;
    }
}

/* ------------------------------------------------------------ arguments ---- */

struct fq_bwd_args {
    const fq_chunk_info *chunks;
    const fq_seq_info *seqs;
    const fq_bf16 *qb, *kb, *vb;
    const float *rq, *rk;
    const float *gamma, *kdecay;
    const fq_bf16 *w, *h, *vn, *a;
    fq_bf16 *dvl;      /* [nc, HV, 64, V]: dv_local (step 3), then dVn (step 4) */
    fq_bf16 *dsl;      /* [nc, HV, K, V]:  dS_local (step 3), then dS_next (step 4) */
    float *dgam;       /* [nc, HV, 64] dgamma of step 3                          */
    float *dkp;        /* [B*T, H, K] bwd_local's dK_O summed over the GVA group  */
    const void *q, *k, *beta, *dout;
    const float *dht;
    void *dq, *dk, *dv, *dg, *dbeta;
    float *dh0;
    fq_dtype dt, gdt;
    int dout_async;    /* dout is bf16 and 16-byte aligned: cp.async rows */
    int H, HV;
    float scale;
    int state_vk;      /* [serving] dht, dh0 (and h0) stored [V][K] (fq_state_at) */
};

/* bwd_local (gdn_cuda_bwd_fused.cu): one block per (chunk, q/k head)
 * looping over the GVA group; dq finished in the block (GVA sum + L2-norm
 * backward), dK_O summed over the group (into a.dkp, for bwd_wy); the
 * chunk-start state is loaded as a second cp.async group, waited for only
 * before dO S^T. nc: chunk-table bound (grid x). */
fq_status fq_bwd_local_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream);
/* bwd_state (gdn_cuda_bwd_state.cu), the reverse state pass laid out like the
 * forward's stage B: dS^T in registers, 16 columns per warp (ks 1) or warp
 * pair (ks 2, K-split); bv state columns per block (16, 32, 64); bv = ks = 0
 * picks by the number of 16-column chains vs SMs, unless the environment
 * variable FLASHQLA_CUDA_BWD_STATE=BV:KS (read once) forces one. Grid
 * N * HV * V / bv. segws: NULL, or the segment table, maps and start states
 * (segs, md, ss, seg_bound of a fused-forward workspace layout, after
 * fq_cuda_fwd_segments; K <= 128): the exact context parallelism of the
 * reverse pass (gdn_cuda_bwd_state.cu). */
fq_status fq_bwd_state_launch(const fq_gdn_params *p, const fq_bwd_args &a, const fq_fwd_ws *segws, int bv, int ks,
                              cudaStream_t stream);
/* bwd_wy (gdn_cuda_bwd_fused.cu): one block per (chunk, q/k head) looping
 * over the GVA group; also finishes dk (GVA sum of the dK_O partials in
 * a.dkp, L2-norm backward). */
fq_status fq_bwd_wy_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream);
/* bwd_local and bwd_wy on sm_90a (gdn_cuda_bwd_fused_sm90.cu): the same blocks
 * and results with wgmma products, K = V = 128; *done = 0 (and nothing
 * launched) where they do not apply (other sizes, no sm_90a code,
 * FLASHQLA_CUDA_BWD_SM90=0). */
fq_status fq_bwd_local90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream,
                                int *done);
fq_status fq_bwd_wy90_launch(const fq_gdn_params *p, const fq_bwd_args &a, int64_t nc, cudaStream_t stream, int *done);

#endif /* FQ_GDN_CUDA_BWD_CUH */
