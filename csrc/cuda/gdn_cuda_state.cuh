/*
 * gdn_cuda_state.cuh — pieces shared by the two sequential state passes,
 * forward stage B (gdn_cuda_fwd_state.cu: S over the chunks) and the
 * backward's reverse pass (gdn_cuda_bwd_state.cu: dS over the chunks in
 * reverse). Both keep a K x 16 slice of the state transposed, X^T (16 state
 * columns v x the warp's K/KS state rows k), as m16n8k16 accumulators: lane
 * (g = lane / 4, t = lane % 4) holds X^T[g (+8)][k0 + 8 nt + 2t (+1)] in
 * X[nt][0..3], which is also the A-operand layout of the next product.
 */
#ifndef FQ_GDN_CUDA_STATE_CUH
#define FQ_GDN_CUDA_STATE_CUH

#include "gdn_cuda_common.cuh"

/* Transposed bf16 store: w = bf16x2 (X[v][k], X[v][k+1]) of a fragment whose
 * lane g holds column v = v0 + g goes into out[k][v]: lanes g and g^1 swap
 * words; even g stores (X[v][k], X[v+1][k]) at row k, odd g stores
 * (X[v-1][k+1], X[v][k+1]) at row k+1. dst = the lane's address,
 * out + (k + (g & 1)) * ld + v0 + (g & ~1) (fq_st_t_lane gives the part that
 * does not depend on the fragment). All 32 lanes must call it; `store`
 * false: the shuffle only. */
static __device__ __forceinline__ void fq_st_transposed(fq_bf16 *dst, uint32_t w, int g, bool store = true)
{
    uint32_t p = __shfl_xor_sync(0xffffffffu, w, 4); /* always: no shuffle under a branch */
    uint32_t x = (g & 1) ? __byte_perm(p, w, 0x7632) : __byte_perm(w, p, 0x5410);
    if (store) *(uint32_t *)dst = x;
}

/* out + (2t + (g & 1)) * ld + (g & ~1): the lane part of fq_st_transposed's
 * address for fragments whose k = k_frag + 2t */
static __device__ __forceinline__ fq_bf16 *fq_st_t_lane(fq_bf16 *out, int64_t ld, int lane)
{
    int g = lane >> 2, t = lane & 3;
    return out + (int64_t)(2 * t + (g & 1)) * ld + (g & ~1);
}

/* dst[off + (k, v)] = the lane's part of X (rows k0.., columns vw..), in
 * the layout vk of fq_state_at. (The loads of h0 / dht are written out in
 * each kernel: through a helper the backward's compiled differently.) */
template <int NKT>
static __device__ __forceinline__ void fq_state_slice_store(const float X[NKT][4], float *dst, int64_t off, int k0,
                                                            int vw, int K, int V, int vk, int g, int t)
{
#pragma unroll
    for (int nt = 0; nt < NKT; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int k = k0 + 8 * nt + 2 * t + (e & 1), v = vw + g + 8 * (e >> 1);
            dst[off + fq_state_at(k, v, K, V, vk)] = X[nt][e];
        }
}

/* X^T[:, k0..] += A B[:, k0..] over a chunk: A = 16 x 64 as four k-steps of
 * A fragments (registers), B = the chunk's 64 x K tile in shared memory (row
 * stride ldb); X holds KW / 8 n8 tiles. */
template <int KW>
static __device__ __forceinline__ void fq_state_rank_update(float X[KW / 8][4], const uint32_t A[4][4],
                                                            const fq_bf16 *B, int ldb, int k0)
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
#pragma unroll
        for (int n2 = 0; n2 < KW / 16; n2++) {
            uint32_t b[4];
            fq_frag_b_kn(b, B, ldb, 16 * kk, k0 + 16 * n2);
            fq_mma_bf16(X[2 * n2], A[kk], b[0], b[1]);
            fq_mma_bf16(X[2 * n2 + 1], A[kk], b[2], b[3]);
        }
    }
}

/* K-split 2: the two warps of a group each hold a partial 16 x 64 product P;
 * both need the sum. fq_pair_put writes this warp's P to its exchange area
 * xo (512 float2); after a barrier over the pair, fq_pair_add adds the
 * partner's (xp) in place, so both warps hold the same sum bitwise. */
static __device__ __forceinline__ void fq_pair_put(const float P[8][4], float2 *xo, int lane)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        xo[(2 * nt) * 32 + lane] = make_float2(P[nt][0], P[nt][1]);
        xo[(2 * nt + 1) * 32 + lane] = make_float2(P[nt][2], P[nt][3]);
    }
}
static __device__ __forceinline__ void fq_pair_add(float P[8][4], const float2 *xp, int lane)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        const float2 p0 = xp[(2 * nt) * 32 + lane], p1 = xp[(2 * nt + 1) * 32 + lane];
        P[nt][0] += p0.x;
        P[nt][1] += p0.y;
        P[nt][2] += p1.x;
        P[nt][3] += p1.y;
    }
}

#endif /* FQ_GDN_CUDA_STATE_CUH */
