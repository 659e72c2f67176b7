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

/* The combine step of context parallelism (the fused forward's, REV = 0;
 * the backward's reverse state pass, REV = 1): one block of K threads
 * (thread = state row kd) per (segment slot, value head, 16 state columns);
 * only a sequence's segment 0 (REV: its last segment, n - 1) works, walking
 * its segments:
 *   forward:  S_0 = h0 at the sequence's slot (0 without one, NaN for a
 *             duplicate slot)                          ->  ss[first]
 *             S_{sigma+1} = M_sigma S_sigma + D_sigma  ->  ss[first + sigma + 1]
 *   REV:      E_{n-1} = dht at the slot (0 without)    ->  ss[first + n - 1]
 *             E_{sigma-1} = M_sigma E_sigma + D_sigma  ->  ss[first + sigma - 1]
 *             (dS at a segment's end from dS at the next one's: the reverse
 *             pass's map, gdn_cuda_bwd_state.cu)
 * M_sigma (K x K) is read by column slices of 32 (K x 32 floats, 16 KB at
 * K = 128), each slice by coalesced 128-byte row pieces (a warp: 4 rows)
 * into shared memory (row stride 33: the row-per-thread reads below hit 32
 * banks), the next slice's pieces in registers while the current one is
 * multiplied: one L2 round trip per slice in flight at a time instead of
 * one per 4 columns per thread. md == NULL (the forward only, REV = 0): md
 * and ss are in o's rows (fq_omap) instead of slots si.cp, si.cp + 1, ... */
template <int K, int REV>
__global__ void __launch_bounds__(K) fq_cp_combine_kernel(const fq_seg_info *segs, const float *md, const float *h0,
                                                          float *ss, int HV, int V, int vk, fq_omap om)
{
    constexpr int SL = 32, LDM = SL + 1, NP = K * SL / 4 / K; /* float4 pieces per thread per slice: 8 */
    __shared__ __align__(16) float S[K][16];
    __shared__ float Ms[K * LDM];
    fq_pdl_trigger();
    fq_pdl_wait();
    const int nvc = V / 16;
    const int vc = blockIdx.x % nvc, j = (blockIdx.x / nvc) % HV, gs = blockIdx.x / (nvc * HV);
    const fq_seg_info si = segs[gs];
    if (si.seq < 0 || si.index != (REV ? si.count - 1 : 0) || si.count < 2) return;
    constexpr int dir = REV ? -1 : 1; /* (the maps walked: si.cp, si.cp + dir, ...) */
    const int kd = threadIdx.x;
    const int64_t hbase = ((int64_t)si.slot * HV + j) * K * V;
    const float fill = si.slot == FQ_SLOT_DUP ? __int_as_float(0x7fc00000) : 0.f;
    float x[16];
#pragma unroll
    for (int c = 0; c < 16; c++) x[c] = h0 && si.slot >= 0 ? h0[hbase + fq_state_at(kd, 16 * vc + c, K, V, vk)] : fill;
    /* md and ss of the sg-th segment walked: by the segments' compact slots si.cp,
     * si.cp + dir, ...; or in o's rows (segment sg from si.bos, si.nchunks chunks
     * each), element (row, col) of a map in its block col / 64 whose first row R
     * (fq_omap_blk) is found once per slice or row piece */
    const int omap = !REV && !md;
    auto mdp = [&](int sg, int64_t R, int row, int col) -> const float * {
        if (omap) return fq_omap_at(om, R, j, row, col & 63);
        return md + ((int64_t)(si.cp + dir * sg) * HV + j) * K * (K + V) + (int64_t)row * (K + V) + col;
    };
    auto blk = [&](int sg, int col) -> int64_t {
        return omap ? fq_omap_blk(om, si.bos, si.nchunks, si.count, om.ncb * sg + (col >> 6)) : 0;
    };
    auto ssp = [&](int sg) -> float * { /* row kd, columns 16 vc .. 16 vc + 15 */
        if (omap) return fq_omap_ss(om, si.bos + (int64_t)64 * si.nchunks * sg, j, (16 * vc) >> 6, kd, (16 * vc) & 63);
        return ss + (((int64_t)(si.cp + dir * sg) * HV + j) * K + kd) * V + 16 * vc;
    };
    float *ss0 = ssp(0);
#pragma unroll
    for (int c = 0; c < 16; c++) ss0[c] = x[c];
    /* piece p of a slice: row (p K + kd) / 8, columns 4 ((p K + kd) % 8) .. + 3 of the slice */
    auto load_slice = [&](float4 (&r)[NP], int sg, int s) {
        const int64_t R = blk(sg, SL * s); /* (a slice of 32 columns is inside one block of 64) */
#pragma unroll
        for (int p = 0; p < NP; p++) {
            const int f = p * K + kd, row = f >> 3, c4 = f & 7;
            r[p] = *(const float4 *)mdp(sg, R, row, SL * s + 4 * c4);
        }
    };
    for (int sg = 0; sg + 1 < si.count; sg++) {
        /* [M | D] of the sg-th segment walked */
        float4 nx[NP];
        load_slice(nx, sg, 0);
#pragma unroll
        for (int c = 0; c < 16; c++) S[kd][c] = x[c];
        /* row kd of D */
        const int64_t RD = blk(sg, K + 16 * vc);
#pragma unroll
        for (int c = 0; c < 16; c += 4) {
            const float4 d = *(const float4 *)mdp(sg, RD, kd, K + 16 * vc + c);
            x[c] = d.x, x[c + 1] = d.y, x[c + 2] = d.z, x[c + 3] = d.w;
        }
#pragma unroll 1
        for (int s = 0; s < K / SL; s++) {
            __syncthreads(); /* S written (s == 0); every thread done with the previous slice */
#pragma unroll
            for (int p = 0; p < NP; p++) {
                const int f = p * K + kd, row = f >> 3, c4 = f & 7;
                float *dst = Ms + row * LDM + 4 * c4;
                dst[0] = nx[p].x, dst[1] = nx[p].y, dst[2] = nx[p].z, dst[3] = nx[p].w;
            }
            __syncthreads();
            if (s + 1 < K / SL) load_slice(nx, sg, s + 1);
            /* x += M[kd][32 s + m] S[32 s + m][:] */
#pragma unroll 4
            for (int m = 0; m < SL; m++) {
                const float a = Ms[kd * LDM + m];
                const float4 *sr = (const float4 *)&S[SL * s + m][0];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const float4 b = sr[q];
                    x[4 * q] += a * b.x, x[4 * q + 1] += a * b.y, x[4 * q + 2] += a * b.z, x[4 * q + 3] += a * b.w;
                }
            }
        }
        float *dst = ssp(sg + 1);
#pragma unroll
        for (int c = 0; c < 16; c++) dst[c] = x[c];
        __syncthreads(); /* every thread done with S and the last slice */
    }
}

#ifdef __cplusplus
/* The combine step over ws's segment slots (ws->segs, md, ss, seg_bound;
 * K = 64 or 128): h0 is the forward's start states (REV = 0) or the
 * backward's dht (REV = 1), in layout p->state_vk. */
template <int REV>
static fq_status fq_cp_combine_launch(const fq_gdn_params *p, const fq_fwd_ws *ws, const float *h0,
                                      cudaStream_t stream)
{
    const unsigned grid = (unsigned)(ws->seg_bound * p->HV * (p->V / 16));
    const int pdl = fq_cuda_pdl_enabled();
    if (p->K == 128)
        return fq_launch_k(fq_cp_combine_kernel<128, REV>, grid, 128, 0, stream, pdl, (const fq_seg_info *)ws->segs,
                           (const float *)ws->md, h0, ws->ss, (int)p->HV, (int)p->V, (int)p->state_vk,
                           fq_omap_of(p));
    if (p->K == 64)
        return fq_launch_k(fq_cp_combine_kernel<64, REV>, grid, 64, 0, stream, pdl, (const fq_seg_info *)ws->segs,
                           (const float *)ws->md, h0, ws->ss, (int)p->HV, (int)p->V, (int)p->state_vk,
                           fq_omap_of(p));
    return fq_cuda_head_dims_unsupported(p);
}
#endif

#endif /* FQ_GDN_CUDA_STATE_CUH */
